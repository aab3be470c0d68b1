"""The OpenAI Agents SDK with its default model (the Responses API) against a running
`k3 serve`: an agent with one function tool, the call forced through `tool_choice`, runs its
tool loop to a final answer.

Usage: python3 agents_tool_loop.py BASE_URL MODEL
Exit 0 when every check passes; exit 3 (and a message) when the SDK is missing.

The demo model's words are random; the protocol is what is checked: the forced call reaches
the tool with arguments of its declared types and the tool's result is the run's final
answer (`tool_use_behavior="stop_on_first_tool"`: the demo model's free text never ends
before its budget, and the SDK raises on an incomplete response).
"""

import sys

try:
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_api,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI
except ImportError as e:
    print(f"the OpenAI Agents SDK is not installed ({e.name}; pip install openai-agents)")
    sys.exit(3)

base, model = sys.argv[1], sys.argv[2]
set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=base + "/v1", api_key="dummy"), use_for_tracing=False)
set_default_openai_api("responses")

calls = []


@function_tool
def get_weather(city: str, days: int) -> str:
    """The weather in a city for the next days."""
    assert isinstance(city, str) and isinstance(days, int), (city, days)
    calls.append((city, days))
    return f"Sunny in {city} for {days} days."


agent = Agent(
    name="k3",
    instructions="Answer in one sentence.",
    model=model,
    tools=[get_weather],
    # Greedy, so a run is repeatable. The random demo model writes free text until its
    # budget ends (an incomplete response, which the SDK raises on), so the tool's result is
    # the final answer: the loop is call, tool, result.
    model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=200),
    tool_use_behavior="stop_on_first_tool",
)
result = Runner.run_sync(agent, "What is the weather in Paris this week?", max_turns=4)
assert calls, "the forced tool was never called"
assert result.final_output.startswith("Sunny in "), result.final_output
print(f"tool calls: {calls}; final answer: {result.final_output!r}")
print("agents tool loop: ok")
