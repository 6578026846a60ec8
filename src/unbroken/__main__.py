from unbroken.cli.main import run

run()
