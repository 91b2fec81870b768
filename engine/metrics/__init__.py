"""Step and request statistics, speculation counters, Prometheus metrics, the periodic log line."""
