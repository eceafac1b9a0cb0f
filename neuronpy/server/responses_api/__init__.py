"""OpenAI's Responses API: POST /v1/responses (streamed with its typed events, or whole), and
stored responses (GET and DELETE /v1/responses/{id}, `previous_response_id`).

A request is a typed ResponsesRequest, checked under the names its client sent, and becomes
the typed chat request it means (protocol.py: its input items as messages, its function tools
as chat tools, `text.format` as the constraint), admitted and run by the same code as
/v1/chat/completions (server/flow.py's admit(), from routes.py); its events become the response
and its stream's events (builder.py), typed models (objects.py, events.py) whose JSON is what
the SDK parses; the store is store.py, and the shape a stored response's file must have
shape.py. A stored response keeps its conversation (input and reply, as chat messages); a
follow-up naming it continues that conversation, and since the prefix cache holds the KV of
its prompt and reply, only the new messages are prefilled
(`usage.input_tokens_details.cached_tokens`).

Within the package the routes import the builder and the store, the builder the events, the
objects and the protocol, the store the shape, never the other way (pyproject's import
contracts). This file imports none of them. A response's id (`resp_<hex>`) is made and
recognized by server/response_ids.py, which the session listing reads too.
"""
