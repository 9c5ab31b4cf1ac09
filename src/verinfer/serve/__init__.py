"""An OpenAI-compatible provider server around a local model, honest or deliberately misconfigured.

``create_app`` builds the FastAPI app, ``serve_in_thread`` runs it on loopback for tests and
demos, ``verinfer serve`` runs it from the command line. See ``app`` for the seed semantics that
make responses replayable by the verifier, and ``config`` for the misconfigurations.
"""

from verinfer.serve.app import ServedModel, create_app
from verinfer.serve.config import ServeConfig, parse_misconfig
from verinfer.serve.runner import serve_in_thread

__all__ = ["ServeConfig", "ServedModel", "create_app", "parse_misconfig", "serve_in_thread"]
