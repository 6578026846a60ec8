import sys

from unbroken.kubernetes.operator.main import main

sys.exit(main())
