"""Who may connect, who they are, and what they may do.

Owns listeners and their security protocols (PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL),
TLS contexts, the SASL mechanisms (PLAIN, SCRAM-SHA-256/512) as sans-I/O state machines,
the salted credential file, per-topic authorization rules, connection limits and byte
quotas. The modules here import only the standard library, trio (session/tls), and
`broker.api`/`broker.handlers.errors` (the SASL API handlers); never `broker.server`.
"""
