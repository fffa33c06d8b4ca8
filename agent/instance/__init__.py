"""One operator instance: the worker process, its recovery bookkeeping, and the spec and control channel it gets from its agent."""
