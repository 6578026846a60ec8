import sys

from unbroken.agent.main import main

sys.exit(main())
