"""The Responses API's stored responses (`store`, true unless the client says otherwise, as
OpenAI's default): each kept response's conversation in chat form, which a later request's
`previous_response_id` continues, and its response object, which `GET /v1/responses/{id}`
returns and `DELETE` forgets; and the background responses still running, which `POST
/v1/responses/{id}/cancel` stops. In memory only, and bounded: the newest `capacity` are kept,
the oldest forgotten first (a restart forgets all, as any server without a database)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from serving.errors import NotFound

CAPACITY = 1024  # responses kept: a long agent session's turns, a few MB of text at most


@dataclass(frozen=True)
class Stored:
    messages: tuple[dict, ...]  # the conversation in chat form, this response's reply last
    response: dict  # the response object as it was answered


class ResponseStore:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()
        # background responses still running: id -> what cancels it (its task is held here
        # too, so that nothing collects it while it runs)
        self._running: dict[str, tuple[Callable[[], None], object]] = {}

    def run(self, response_id: str, cancel: Callable[[], None], task: object) -> None:
        """A background response started: `cancel` stops it (its task then stores it)."""
        with self._lock:
            self._running[response_id] = (cancel, task)

    def ran(self, response_id: str) -> None:
        with self._lock:
            self._running.pop(response_id, None)

    def cancel(self, response_id: str) -> object | None:
        """Stop a running background response: its task (to wait for), or None when none
        of that id is running."""
        with self._lock:
            running = self._running.get(response_id)
        if running is None:
            return None
        running[0]()
        return running[1]

    def put(self, stored: Stored) -> None:
        with self._lock:
            self._kept[stored.response["id"]] = stored
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def get(self, response_id: str) -> Stored:
        with self._lock:
            stored = self._kept.get(response_id)
        if stored is None:
            raise NotFound(f"Response with id '{response_id}' not found (not stored, "
                           "forgotten, or deleted)")
        return stored

    def delete(self, response_id: str) -> None:
        with self._lock:
            if self._kept.pop(response_id, None) is None:
                raise NotFound(f"Response with id '{response_id}' not found")

    def __len__(self) -> int:
        return len(self._kept)
