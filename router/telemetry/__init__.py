"""What the gateway tells operators: its Prometheus metrics, the parser of a /metrics
page, credentials kept out of log lines."""
