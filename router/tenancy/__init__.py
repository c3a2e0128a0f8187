"""Who is calling (API keys, tenant headers) and which ``cache_salt`` their requests carry."""
