"""Classroom rooms (issue 25): a teacher's room where the class's own requests are the demo of
batching. Students join by name and chat; their requests run together on the room's own engine
(a sibling of the server's, with the room's settings); the presenter's view watches the engine's
steps as they happen, and the session is kept in SQLite, exported and replayed.

Modules: codes (secrets), names (display names), settings, records (what a request and a step
look like to the room), room_engine (the sibling engine), room (a live room), updates
(room_update messages), registry (the open rooms, limits, the ticker), store (SQLite), views
(HTTP), messages (websocket), qr (segno), replay (export JSON).
"""

import atexit
import tempfile
from pathlib import Path

from .registry import Registry
from .store import Store, default_path


def init_app(app, config, runtime) -> Registry:
    from . import views
    if config.rooms_db_path:
        path = config.rooms_db_path
    elif config.testing:                  # a test server starts with no rooms of earlier runs
        path = Path(tempfile.mkdtemp(prefix="sendlens-rooms-")) / "rooms.sqlite3"
    else:
        path = default_path(config.engine.cache_dir, config.replica_id)
    registry = Registry(config, Store(path), runtime.engine, runtime.shared.routes)
    app.extensions["sendlens_rooms"] = registry
    app.register_blueprint(views.bp)
    atexit.register(registry.shutdown)
    return registry
