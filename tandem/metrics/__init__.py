"""Prometheus metrics (--enable-metrics) and request logging (--log-requests)."""
