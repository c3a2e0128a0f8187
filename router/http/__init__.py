"""The served HTTP app: middleware, routes, handlers, connection limits, the start-up summary."""
