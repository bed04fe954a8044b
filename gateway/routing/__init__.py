"""Which node serves a request: discovery and the registry (which nodes exist), the router (a pure choice), the
activator (hold while none can), the relay (one request's life with failover) and the node client."""
