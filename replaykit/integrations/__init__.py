"""Integrations with libraries whose code branches on capture; each imports only its library and torch,
and is loaded by :mod:`replaykit.verify.contexts` when that library is already imported."""
