from poslsh_cli.app.cli import run

run()
