"""Above the gateway: explain, diagnose, the admin routes, the offline gateway, the shared
command-line input checks."""
