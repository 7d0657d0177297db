"""The talk page at ``GET /``: static files shipped in the package (``page/``), read once, no build step.

``index.html`` carries two values the server fills in: whether an API key is required and the model's name.
"""

from __future__ import annotations

import html
from pathlib import Path

from metronome.serving.gateway.ws_transport import HttpReply

PREFIX = "/page/"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8"}


class TalkPage:
    def __init__(self, model_name: str, auth_required: bool) -> None:
        folder = Path(__file__).with_name("page")     # package data beside this module
        self.files = {f.name: f.read_bytes() for f in folder.iterdir() if f.name.endswith(tuple(CONTENT_TYPES))}
        index = self.files.pop("index.html").decode()
        index = index.replace("{{AUTH_REQUIRED}}", "true" if auth_required else "false")
        self.index = index.replace("{{MODEL}}", html.escape(model_name, quote=True)).encode()

    def reply(self, path: str) -> HttpReply | None:
        """The page or one of its files for ``path``; None when the path is not the page's."""
        if path in ("/", "/index.html"):
            return HttpReply(200, self.index, CONTENT_TYPES[".html"], {"Cache-Control": "no-cache"})
        if path.startswith(PREFIX) and path[len(PREFIX):] in self.files:
            name = path[len(PREFIX):]
            return HttpReply(200, self.files[name], CONTENT_TYPES[name[name.rindex("."):]],
                             {"Cache-Control": "no-cache"})
        return None
