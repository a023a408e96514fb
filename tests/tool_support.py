"""Helpers of the tool-calling tests: chat templates in the shape of each family's (Qwen
2.5's ChatML with ``<tool_call>``, LLaMA 3.1's headers with ``ipython``, Mistral v0.3's
``[AVAILABLE_TOOLS]`` / ``[TOOL_CALLS]`` that refuses call ids not 9 characters long),
written for these tests, and tools whose arguments a random model can always complete
under a grammar (every string and number bounded)."""

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls or [] %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_TEMPLATE = """\
<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
Answer a call as JSON {"name": function name, "parameters": its arguments}. Functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{% endif %}<|eot_id|>
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}\
<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}\
{{ {"name": call.function.name, "parameters": call.function.arguments} | tojson }}\
{% endfor %}<|eom_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL_TEMPLATE = """\
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][\
{%- for call in message.tool_calls %}
{%- if call.id | length != 9 %}\
{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}\
{{ {"name": call.function.name, "arguments": call.function.arguments, "id": call.id} | tojson }}\
{%- if not loop.last %}, {% endif %}{% endfor %}]</s>
{%- elif message.role == 'tool' %}\
[TOOL_RESULTS]{{ {"call_id": message.tool_call_id, "content": message.content} | tojson }}\
[/TOOL_RESULTS]
{%- else %}{{ message.content }}</s>{% endif %}{% endfor %}"""

TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3_json": LLAMA3_TEMPLATE,
             "mistral": MISTRAL_TEMPLATE}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, some days ahead",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"$ref": "#/$defs/small"}}, "required": ["a", "b"],
        "$defs": {"small": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
