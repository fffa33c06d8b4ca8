"""One operator instance: the sans-IO `Instance` (core.py) with its scaling driver, recovery and
round bookkeeping, the worker process that is its shell, and the spec and control channel it gets
from its agent."""
