"""`/v1/responses`: create (whole or streamed), retrieve, list input items, delete.

A request becomes a chat request (conversion.py) and runs through `server.chat.prepare_chat` and
`server.generation.respond`, as chat completions do. A stored response belongs to the API key that
created it: under any other key its id does not exist (404).
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Query, Request

from server.chat import prepare_chat
from server.context import ServerContext, get_context, require_api_key
from server.errors import APIError, parse_body
from server.generation import respond
from server.responses.conversion import check_supported, chat_request, function_tools, \
    input_items
from server.responses.events import stream_events
from server.responses.output import ResponseBuilder
from server.responses.protocol import INPUT_ITEMS, ResponseObject, ResponsesRequest
from server.responses.store import ResponseStore, owner_of
from server.tenants import cache_partition

router = APIRouter(dependencies=[Depends(require_api_key)])


def _owner(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return owner_of(token.strip() if scheme.lower() == "bearer" else "")


def _store(context: ServerContext) -> ResponseStore:
    return context.response_store


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No response found with id '{response_id}'.", param=param,
                    code="response_not_found")


class _Run:
    """What `respond` needs of a response: its id, `complete` and `events`."""

    def __init__(self, builder: ResponseBuilder, save):
        self.id = builder.id
        self.builder = builder
        self.save = save

    async def complete(self, finals: dict) -> ResponseObject:
        response = self.builder.complete(finals[0])
        await self.save(response)
        return response

    def events(self, fanout):
        return stream_events(self.builder, fanout, self.save)


@router.post("/v1/responses")
async def create_response(request: Request, context: ServerContext = Depends(get_context)):
    body = await parse_body(request, ResponsesRequest)
    check_supported(body)
    owner = _owner(request)
    history = []
    if body.previous_response_id is not None:
        stored = await _store(context).history(owner, body.previous_response_id)
        if stored is None:
            raise APIError(404, f"Previous response with id '{body.previous_response_id}' not "
                           "found.", param="previous_response_id",
                           code="previous_response_not_found")
        history = INPUT_ITEMS.validate_python(stored)
    items = input_items(body)
    chat = chat_request(body, history, items)
    plan = await prepare_chat(context, chat, cache_partition(request, None))
    builder = ResponseBuilder(context, body, plan, function_tools(body))
    stored_items = [item.model_dump(exclude_none=True) for item in items]

    async def save(response: ResponseObject) -> None:
        if response.store:
            await _store(context).put(owner, response.model_dump(mode="json"), stored_items)

    return await respond(request, context, _Run(builder, save), plan.choices, bool(body.stream))


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request,
                            context: ServerContext = Depends(get_context)):
    response = await _store(context).get(_owner(request), response_id)
    if response is None:
        raise _not_found(response_id)
    return response


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request,
                           context: ServerContext = Depends(get_context),
                           order: Literal["asc", "desc"] = "desc",
                           limit: int = Query(20, ge=1, le=100), after: str | None = None):
    items = await _store(context).input_items(_owner(request), response_id)
    if items is None:
        raise _not_found(response_id)
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise APIError(400, f"no input item '{after}' in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "has_more": len(items) > limit,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request,
                          context: ServerContext = Depends(get_context)):
    if not await _store(context).delete(_owner(request), response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
