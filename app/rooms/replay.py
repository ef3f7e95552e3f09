"""A room's session as JSON (schema `sendlens.room/1`), for the export and the replay page.

    {"schema": "sendlens.room/1",
     "room": {"code", "created_at", "state", "settings", "students": [names]},
     "settings_log": [{"at", "step", "settings"}],   # the room's settings from its start, each change
                                                     # and the room's steps done when it applied (it
                                                     # holds from the step of that number on; a clear
                                                     # starts the log again at step 0)
     "steps": [step rows, oldest first: StepTrace dicts, slots naming {"request", "student", ...}],
     "requests": [records: id, student, state, token counts, ttft_s, tpot_s, waited_s, text, ...]}

Read from the store (so a closed room, or one from before a restart, exports the same), after
the registry wrote what was still in memory. The replay page draws the recorded steps with the
same view as the live room: no engine work.
"""

import time

SCHEMA = "sendlens.room/1"


def export(registry, stored: dict) -> dict:
    registry.save()
    code = stored["code"]
    store = registry.store
    stored = store.room(code)
    return {
        "schema": SCHEMA,
        "exported_at": time.time(),
        "room": {"code": code, "created_at": stored["created_at"], "state": stored["state"],
                 "settings": stored["settings"], "students": [m["name"] for m in store.members(code)]},
        "settings_log": store.settings_log(code),
        "steps": store.steps(code),
        "requests": store.records(code),
    }
