"""Bytes to a replica and back: the keep-alive HTTP/1.1 client, the proxy of one request,
and the transport the exchange sends a leg through."""
