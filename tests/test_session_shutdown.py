"""shutdown() drains the engine: work still queued may ask the session for its reducer."""

import threading
import time

import cgx.torch as hvd
from cgx import session
from cgx.config import Config


def test_queued_work_that_asks_for_the_reducer_does_not_deadlock_shutdown():
    hvd.init(Config())
    seen = []

    def job():
        time.sleep(0.3)  # still queued when shutdown() begins
        seen.append(session.reducer().transport.size)

    session.submit(job, label="late")
    done = threading.Event()
    t = threading.Thread(target=lambda: (hvd.shutdown(), done.set()), daemon=True)
    t.start()
    assert done.wait(30), "shutdown() did not return: the engine's work waited for the session"
    assert seen == [1]
