from poslsh_cli.cli import run

run()
