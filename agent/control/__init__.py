"""The control vocabulary shared by the agent and fogctl: the fleet as the retained states describe
it, and the steering requests (scale, drain, pin) with the rules an agent checks them by. Pure:
parsing and checking only, so that the daemon (agent/node) and the CLI (agent/fogctl) import it
without importing each other."""
