"""Your own tool-using environment in ~30 lines: a stock-lookup agent, trained with GRPO.

Run:  .venv/bin/python examples/custom_env.py
Or from the CLI, with this file as a plugin (it registers the `stock` task and environment):
      .venv/bin/tamer sft --import examples/custom_env.py --set task.name=stock --set agent.show_tools=false
"""

import random

from tamer.tasks import TASK_SOURCES, Task
from tamer.tasks.base import is_correct
from tamer.tasks.env import ENVIRONMENTS
from tamer.tasks.tool_env import ToolEnvironment
from tamer.tools.schema import ToolSet

STOCK = {"apple": 12, "pear": 7, "plum": 30, "fig": 4}


@ENVIRONMENTS.register("stock")
class StockEnv(ToolEnvironment):
    def build_tools(self) -> ToolSet:
        return ToolSet([self.stock])

    def stock(self, item: str) -> int:
        """How many units of an item the warehouse holds.

        Args:
            item: The item's name, e.g. apple.
        """
        return STOCK[item]  # an unknown item raises: the agent sees the error and can retry

    def finish(self, final_text: str) -> dict:
        return {"success": is_correct(final_text, self.task)}


@TASK_SOURCES.register("stock")
class StockTasks:
    name = "stock"

    def split(self):
        pairs = [(a, b) for a in STOCK for b in STOCK if a < b]
        tasks = [Task(id=f"{a}+{b}", messages=({"role": "user", "content": f"Total {a}s and {b}s in stock?"},),
                      answer=str(STOCK[a] + STOCK[b]), env="stock") for a, b in pairs]
        return tasks[:4], tasks[4:]

    def demonstrate_turns(self, task: Task, rng: random.Random) -> list[str]:
        a, b = task.id.split("+")
        call = '<tool_call>{{"name":"stock","arguments":{{"item":"{}"}}}}</tool_call>'
        return [call.format(a), call.format(b), f"<answer>{task.answer}</answer>"]

    def demonstrate(self, task, rng):
        return "".join(self.demonstrate_turns(task, rng))


if __name__ == "__main__":
    from tamer.config import load_config
    from tamer.pipeline import RunConfig, run_demo

    config = load_config(RunConfig, overrides=[
        "task.name=stock", "output_dir=runs/stock", "agent.show_tools=false", "sft.steps=200",
        "rl.steps=4", "rl.prompts_per_step=4", "rl.group_size=4", "rl.max_new_tokens=48", "rl.eval_every=2",
        "eval.size=0", "eval.max_new_tokens=48", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
        "model.tiny.intermediate_size=128",
    ])
    summary = run_demo(config)
    print({k: summary[k] for k in ("demonstrator", "sft", "rl", "seconds")})
