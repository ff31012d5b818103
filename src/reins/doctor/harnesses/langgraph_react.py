"""`reins doctor langgraph`: LangGraph's prebuilt ReAct agent (`create_react_agent`) on
langchain-openai's `ChatOpenAI` (which reads OPENAI_BASE_URL / OPENAI_API_KEY); LangGraph runs
the tool and sends its result back. The few-shot calls go in as the text the engine renders a
call as (LangGraph would otherwise ask for their results); the prompt is the same. Then the
follow-up questions, each a new `invoke` on the whole history, up to `turns()` calls."""

from __future__ import annotations

from typing import Any

from reins.doctor.harnesses import task


def main() -> None:
    task.require("langgraph", "langgraph")
    task.require("langchain_openai", "langchain-openai")
    task.env("OPENAI_BASE_URL")
    from langchain_core.messages import AIMessage, HumanMessage, convert_to_messages
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import create_react_agent

    from reins.engine.chat import prepare_messages

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city"""
        return task.TOOL_RESULT

    llm = ChatOpenAI(
        model=task.MODEL,
        temperature=0,
        max_tokens=task.MAX_TOKENS,
        timeout=task.TIMEOUT_S,
        max_retries=0,
    )
    graph: Any = create_react_agent(llm, tools=[get_weather])
    rendered = prepare_messages(task.chat_history(), None, native_tools=False)
    messages: list[Any] = list(convert_to_messages(rendered))
    calls, number = 0, 0
    limit = task.turns()
    while calls < limit:
        before = len(messages)
        # Each model call is one step of the graph, each tool run another.
        try:
            result = graph.invoke({"messages": messages}, {"recursion_limit": 2 * (limit - calls)})
        except GraphRecursionError:  # the model kept calling the tool: the call budget is spent
            print("the agent reached its call budget", flush=True)
            return
        messages = list(result["messages"])
        replies = [m for m in messages[before:] if isinstance(m, AIMessage)]
        calls += max(1, len(replies))
        print(f"invoke {number + 1}: {[r.content or r.tool_calls for r in replies]}", flush=True)
        messages.append(HumanMessage(task.follow_up(number)))
        number += 1


if __name__ == "__main__":
    main()
