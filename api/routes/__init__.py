"""HTTP routes, thin: parse, call the store or a use case, shape the response."""
