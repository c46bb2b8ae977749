"""Deployment tools: `python -m deploy.render_serve_config`, `python -m deploy.validate_manifests`."""
