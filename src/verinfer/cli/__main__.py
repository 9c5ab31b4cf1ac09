from verinfer.cli.main import app

app()
