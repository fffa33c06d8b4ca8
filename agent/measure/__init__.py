"""What a node measures: capacity, latencies, psutil resources, netem emulation, Prometheus metrics."""
