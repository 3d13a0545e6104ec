"""``python -m loadtest.podsim``: run one simulated vLLM pod (see ``--help``)."""

from loadtest.podsim.cli import main

raise SystemExit(main())
