"""The stub engine (tests/stub_engine.py) in a process of its own, so a fault test can SIGKILL it.

STUBBED: the model (see tests/stub_engine.py). `python -m tests.faults.stub_process PORT` serves
it on 127.0.0.1:PORT; `GET /stub/received` says how many completion requests it has received, so
a test can wait for calls to be in flight at the engine without sleeping.
"""

from __future__ import annotations

import sys

import uvicorn

from tests.stub_engine import create_stub_app


def main(port: int) -> None:
    app = create_stub_app()

    @app.get("/stub/received")
    async def received() -> dict[str, int]:
        return {"received": len(app.state.requests)}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(int(sys.argv[1]))
