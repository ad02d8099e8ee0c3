"""The JSON shapes jobs come in and records go out in, shared by the command
line and the service: one declared job request from which every dialect's
parsing and the OpenAPI document come, and the records."""
