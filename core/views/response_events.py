"""The Responses API's stream events of one response, in OpenAI's order: response.created (and .queued for a
background response), .in_progress, then per output item .output_item.added (a message's
.content_part.added), its deltas (.output_text.delta, .function_call_arguments.delta), and once the answer is
final each item's .done events, and .completed / .incomplete / .failed (a cancelled response ends with
.failed, its status `cancelled`).

Sequence numbers count one per event and one per character of a delta, so the stream of a response replayed
once it has ended (resumed with GET ?stream=true&starting_after=N) numbers its events as the live stream did
for the same text: a resumption inside a delta gets the rest of that delta's text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.core.views.response_objects import OutputText, item_id, message_item, text_part

FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed", "cancelled": "response.failed"}
DELTA_TYPES = ("response.output_text.delta", "response.function_call_arguments.delta")


@dataclass
class _OpenItem:
    kind: str  # "message" or "function_call"
    id: str
    output_index: int
    text: str = ""  # streamed so far: the message's text or the call's arguments
    name: str = ""
    call_id: str = ""


@dataclass
class ResponseEvents:
    """Turns a response's chat deltas (core/views/tool_stream.py) into numbered Responses events."""

    job_id: str
    sequence: int = -1
    items: list[_OpenItem] = field(default_factory=list)

    def opening(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        events = [self._event("response.created", response=response)]
        if response["status"] == "queued":
            events.append(self._event("response.queued", response=response))
        return [*events, self._event("response.in_progress", response={**response, "status": "in_progress"})]

    def deltas(self, chat_deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in chat_deltas:
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls", []):
                events += self._call(call)
        return events

    def closing(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """The final items' missing deltas, every item's .done events, and the final event."""
        events: list[dict[str, Any]] = []
        final = response["output"]
        for item in final:  # items the stream never opened (calls read at the end), whole
            events += self._catch_up(item)
        for item in self.items:
            events += self._done(item, next((f for f in final if f["id"] == item.id), None))
        return [*events, self._event(FINAL_EVENTS[response["status"]], response=response)]

    def _text(self, piece: str) -> list[dict[str, Any]]:
        item = next((i for i in self.items if i.kind == "message"), None)
        events = self._open_message() if item is None else []
        item = next(i for i in self.items if i.kind == "message")
        if not piece:
            return events
        item.text += piece
        delta = self._event("response.output_text.delta", len(piece), **self._at(item), content_index=0,
                            delta=piece, logprobs=[])
        return [*events, delta]

    def _open_message(self) -> list[dict[str, Any]]:
        item = self._open("message", item_id(self.job_id, "msg", 0))
        empty = OutputText(item.id, "", [])
        return [self._added(item, {**message_item(empty, "in_progress"), "content": []}),
                self._event("response.content_part.added", **self._at(item), content_index=0,
                            part=text_part(empty))]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        calls = [i for i in self.items if i.kind == "function_call"]
        index = call["index"]
        if index >= len(calls):
            item = self._open("function_call", item_id(self.job_id, "fc", index))
            item.name, item.call_id = call["function"]["name"], call["id"]
            events.append(self._added(item, self._call_item(item, "", "in_progress")))
        else:
            item = calls[index]
        piece = call["function"].get("arguments", "")
        if piece:
            item.text += piece
            events.append(self._event("response.function_call_arguments.delta", len(piece), **self._at(item),
                                      delta=piece))
        return events

    def _catch_up(self, final: dict[str, Any]) -> list[dict[str, Any]]:
        streamed = next((i for i in self.items if i.id == final["id"]), None)
        if final["type"] == "message":
            text = final["content"][0]["text"]
            done = streamed.text if streamed is not None else ""
            return self._text(text[len(done):] if text.startswith(done) else "")
        if streamed is not None:
            arguments = final["arguments"]
            rest = arguments[len(streamed.text):] if arguments.startswith(streamed.text) else ""
            return self._call({"index": self._call_index(streamed), "function": {"arguments": rest}})
        index = len([i for i in self.items if i.kind == "function_call"])
        return self._call({"index": index, "id": final["call_id"],
                           "function": {"name": final["name"], "arguments": final["arguments"]}})

    def _call_index(self, item: _OpenItem) -> int:
        return [i.id for i in self.items if i.kind == "function_call"].index(item.id)

    def _done(self, item: _OpenItem, final: dict[str, Any] | None) -> list[dict[str, Any]]:
        at = self._at(item)
        if item.kind == "function_call":
            arguments = final["arguments"] if final is not None else item.text
            done = self._call_item(item, arguments, "completed")
            return [self._event("response.function_call_arguments.done", **at, arguments=arguments,
                                name=item.name),
                    self._event("response.output_item.done", output_index=item.output_index, item=done)]
        part = final["content"][0] if final is not None else text_part(OutputText(item.id, item.text, []))
        whole = final if final is not None else message_item(OutputText(item.id, item.text, []), "completed")
        return [self._event("response.output_text.done", **at, content_index=0, text=part["text"],
                            logprobs=part["logprobs"]),
                self._event("response.content_part.done", **at, content_index=0, part=part),
                self._event("response.output_item.done", output_index=item.output_index, item=whole)]

    def _open(self, kind: str, id_: str) -> _OpenItem:
        item = _OpenItem(kind, id_, len(self.items))
        self.items.append(item)
        return item

    def _added(self, item: _OpenItem, shown: dict[str, Any]) -> dict[str, Any]:
        return self._event("response.output_item.added", output_index=item.output_index, item=shown)

    @staticmethod
    def _call_item(item: _OpenItem, arguments: str, status: str) -> dict[str, Any]:
        return {"id": item.id, "type": "function_call", "status": status, "call_id": item.call_id,
                "name": item.name, "arguments": arguments}

    @staticmethod
    def _at(item: _OpenItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.output_index}

    def _event(self, kind: str, width: int = 1, **fields: Any) -> dict[str, Any]:
        self.sequence += width
        return {"type": kind, "sequence_number": self.sequence, **fields}


def replayed(job_id: str, opened: dict[str, Any], final: dict[str, Any]) -> list[dict[str, Any]]:
    """The whole stream of an ended response: as `opened` (the response at its creation) began and as
    `final` ended, its items' text in one delta each."""
    events = ResponseEvents(job_id)
    return [*events.opening(opened), *events.closing(final)]


def after(events: list[dict[str, Any]], starting_after: int | None) -> list[dict[str, Any]]:
    """The events numbered after `starting_after`; a delta that spans it keeps the rest of its text."""
    if starting_after is None:
        return events
    kept = []
    for event in events:
        number = event["sequence_number"]
        if number <= starting_after:
            continue
        if event["type"] in DELTA_TYPES:
            first = number - len(event["delta"]) + 1  # the number of its first character
            if first <= starting_after:
                event = {**event, "delta": event["delta"][starting_after - first + 1:]}
        kept.append(event)
    return kept
