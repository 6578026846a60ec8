import sys

from unbroken.operator.main import main

sys.exit(main())
