"""kvserve.faces.models: holding a model while a response is sent, and giving up when the client leaves."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.faces.models import acquire_model
from kvserve.faces.sse import ClientDisconnected
from kvserve.serving.manager import ModelManager, ModelSpec


class FakeRunner:
    def __init__(self, spec):
        self.spec = spec

    def require_ready(self):
        pass


class FakeState:
    def __init__(self, manager):
        self.manager = manager

    async def acquire(self, name, keep_alive=None):
        return await self.manager.acquire(ModelSpec(name), keep_alive)


class SlowDisconnect:
    """A client whose disconnect check takes 50 ms and says it left."""

    async def is_disconnected(self) -> bool:
        await asyncio.sleep(0.05)
        return True


def test_a_lease_that_arrives_while_the_disconnect_is_noticed_is_released():
    gate = asyncio.Event()

    def loader(spec):
        return FakeRunner(spec)

    async def main():
        m = ModelManager(loader)
        st = FakeState(m)

        async def acquire_after_gate(name, keep_alive=None):
            await gate.wait()
            return await m.acquire(ModelSpec(name), keep_alive)

        st.acquire = acquire_after_gate

        async def open_gate_soon():
            await asyncio.sleep(0.03)  # during the 50 ms disconnect check
            gate.set()

        asyncio.ensure_future(open_gate_soon())
        with pytest.raises(ClientDisconnected):
            await acquire_model(st, "m", 0, SlowDisconnect(), poll_s=0.01)
        await asyncio.sleep(0.1)
        await m._closed()
        assert m.get("m") is None  # keep_alive 0 and no hold left: unloaded

    asyncio.run(main())


def test_encoders_list_the_embedding_capability():
    from kvserve.faces.models import _capabilities
    from kvserve.serving.state import ServableModel

    class Encoder:
        task = "embed"

    class Chat:
        pass

    assert _capabilities(ServableModel("e", "", [], Encoder(), False, 0, 0.0)) == ["embedding"]
    assert _capabilities(ServableModel("c", "", [], Chat(), False, 0, 0.0)) == ["completion"]
    assert _capabilities(ServableModel("u", "/no/such/file", [], None, False, 0, 0.0)) == ["completion"]
