"""`python -m agent` is the same as the `fog-agent` command."""

from agent.cli.main import main

raise SystemExit(main())
