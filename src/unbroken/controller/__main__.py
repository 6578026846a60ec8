import sys

from unbroken.controller.main import main

sys.exit(main())
