"""The OpenAI Agents SDK (`openai-agents`) running an agent with one function tool against the
live server over the Responses API: the tool is called, its output goes back, an answer comes."""

from __future__ import annotations

import asyncio

import pytest

agents = pytest.importorskip("agents", reason="openai-agents is in the dev extras")


def test_an_agent_calls_its_tool_and_answers(server):
    import openai
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool
    from agents.items import ToolCallItem, ToolCallOutputItem

    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees in {city}."

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                max_retries=0)
    agent = Agent(
        name="weather", instructions="Answer questions about the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=server.model, openai_client=client),
        # A 135M model needs telling: call the tool first; the SDK then resets the choice to
        # auto for the answer (reset_tool_choice).
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60))

    async def run():
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    result = asyncio.run(run())
    assert len(calls) == 1 and calls[0]
    kinds = [type(item) for item in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds
    assert isinstance(result.final_output, str) and result.final_output.strip()
