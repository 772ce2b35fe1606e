import sys

from agent.app.cli import main

sys.exit(main())
