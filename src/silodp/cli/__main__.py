"""``python -m silodp.cli``: the ``silodp`` command."""

from silodp.cli import app

app()
