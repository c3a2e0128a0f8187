"""A parsed request's path: prepare, plan (legs), the exchange that drives a routed
request's life, accounting, learning; the forwarder of the endpoints not routed on a prompt."""
