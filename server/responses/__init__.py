"""OpenAI's Responses API (`/v1/responses`) on the chat completions engine path, with stored
responses: protocol (wire models), conversion (to a chat request), output (the response object),
events (streaming), store (SQLite) and routes."""
