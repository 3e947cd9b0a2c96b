"""What every API surface of the web process shares: request context, error rendering, body
parsers, middleware, latency, the pool overlay, the catalog view and the registry pulls."""
