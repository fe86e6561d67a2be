"""--chat-template with llama-server's built-in names: each renders the text llama.cpp's
llm_chat_apply_template writes. The expected texts are llama.cpp's own reference outputs
(tests/test-chat-template.cpp, `expected_output`) for its fixed conversation."""

from __future__ import annotations

import pytest

from kvserve.chat.builtin_templates import (
    BUILTIN_TEMPLATES,
    ChatTemplateChoiceError,
    builtin_names,
    resolve_chat_template,
)
from kvserve.chat.template import ChatTemplate

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you"},
    {"role": "assistant", "content": "   I am an assistant   "},
    {"role": "user", "content": "Another question"},
]

EXPECTED = {
    # not in llama.cpp's test: the text of its llm_chat_apply_template branch for LLM_CHAT_TEMPLATE_OPENAI_MOE
    "gpt-oss": "<|start|>system<|message|>You are a helpful assistant<|end|><|start|>user<|message|>Hello<|end|>"
               "<|start|>assistant<|message|>Hi there<|return|><|start|>user<|message|>Who are you<|end|>"
               "<|start|>assistant<|message|>   I am an assistant   <|return|><|start|>user<|message|>Another "
               "question<|end|><|start|>assistant",
    "chatml": "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
              "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n"
              "<|im_start|>assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question<|im_end|>\n"
              "<|im_start|>assistant\n",
    "llama2": "[INST] You are a helpful assistant\nHello [/INST]Hi there</s>[INST] Who are you [/INST]   I am an "
              "assistant   </s>[INST] Another question [/INST]",
    "llama2-sys-bos": "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s><s>[INST] "
                      "Who are you [/INST]   I am an assistant   </s><s>[INST] Another question [/INST]",
    "llama2-sys-strip": "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s>[INST] "
                        "Who are you [/INST]I am an assistant</s>[INST] Another question [/INST]",
    "monarch": "system\nYou are a helpful assistant</s>\n<s>user\nHello</s>\n<s>assistant\nHi there</s>\n<s>user\n"
               "Who are you</s>\n<s>assistant\n   I am an assistant   </s>\n<s>user\nAnother question</s>\n"
               "<s>assistant\n",
    "gemma": "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\nHi there"
             "<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\nI am an assistant"
             "<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n",
    "orion": "Human: You are a helpful assistant\n\nHello\n\nAssistant: </s>Hi there</s>Human: Who are you\n\n"
             "Assistant: </s>   I am an assistant   </s>Human: Another question\n\nAssistant: </s>",
    "openchat": "You are a helpful assistant<|end_of_turn|>GPT4 Correct User: Hello<|end_of_turn|>GPT4 Correct "
                "Assistant: Hi there<|end_of_turn|>GPT4 Correct User: Who are you<|end_of_turn|>GPT4 Correct "
                "Assistant:    I am an assistant   <|end_of_turn|>GPT4 Correct User: Another question<|end_of_turn|>"
                "GPT4 Correct Assistant:",
    "deepseek": "You are a helpful assistant### Instruction:\nHello\n### Response:\nHi there\n<|EOT|>\n### "
                "Instruction:\nWho are you\n### Response:\n   I am an assistant   \n<|EOT|>\n### Instruction:\n"
                "Another question\n### Response:\n",
    "vicuna": "You are a helpful assistant\n\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who are you\nASSISTANT:    "
              "I am an assistant   </s>\nUSER: Another question\nASSISTANT:",
    "vicuna-orca": "SYSTEM: You are a helpful assistant\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who are you\n"
                   "ASSISTANT:    I am an assistant   </s>\nUSER: Another question\nASSISTANT:",
    "command-r": "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a helpful assistant<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hello<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
                 "<|CHATBOT_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Who are you"
                 "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>I am an assistant<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Another question<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
                 "<|CHATBOT_TOKEN|>",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|><|start_header_id|>"
              "user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there"
              "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|><|start_header_id|>"
              "assistant<|end_header_id|>\n\nI am an assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
              "Another question<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "phi3": "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n"
            "<|user|>\nWho are you<|end|>\n<|assistant|>\n   I am an assistant   <|end|>\n<|user|>\nAnother question"
            "<|end|>\n<|assistant|>\n",
    "chatglm3": "[gMASK]sop<|system|>\n You are a helpful assistant<|user|>\n Hello<|assistant|>\n Hi there<|user|>\n"
                " Who are you<|assistant|>\n    I am an assistant   <|user|>\n Another question<|assistant|>",
    "chatglm4": "[gMASK]<sop><|system|>\nYou are a helpful assistant<|user|>\nHello<|assistant|>\nHi there<|user|>\n"
                "Who are you<|assistant|>\n   I am an assistant   <|user|>\nAnother question<|assistant|>\n",
    "glmedge": "<|system|>\nYou are a helpful assistant<|user|>\nHello<|assistant|>\nHi there<|user|>\nWho are you"
               "<|assistant|>\n   I am an assistant   <|user|>\nAnother question<|assistant|>",
    "minicpm": "You are a helpful assistant<用户>Hello<AI>Hi there<用户>Who are you<AI>I am an assistant<用户>"
               "Another question<AI>",
    "deepseek2": "You are a helpful assistant\n\nUser: Hello\n\nAssistant: Hi there<｜end▁of▁sentence｜>User: Who are "
                 "you\n\nAssistant:    I am an assistant   <｜end▁of▁sentence｜>User: Another question\n\nAssistant:",
    "mistral-v1": " [INST] You are a helpful assistant\n\nHello [/INST] Hi there</s> [INST] Who are you [/INST]    "
                  "I am an assistant   </s> [INST] Another question [/INST]",
    "mistral-v3": "[INST] You are a helpful assistant\n\nHello[/INST] Hi there</s>[INST] Who are you[/INST] I am an "
                  "assistant</s>[INST] Another question[/INST]",
    # the formats below follow src/llama-chat.cpp (llama.cpp's test lists no legacy output for them)
    "mistral-v7": "[SYSTEM_PROMPT] You are a helpful assistant[/SYSTEM_PROMPT][INST] Hello[/INST] Hi there</s>"
                  "[INST] Who are you[/INST]    I am an assistant   </s>[INST] Another question[/INST]",
    "deepseek3": "You are a helpful assistant\n\n<｜User｜>Hello<｜Assistant｜>Hi there<｜end▁of▁sentence｜><｜User｜>"
                 "Who are you<｜Assistant｜>   I am an assistant   <｜end▁of▁sentence｜><｜User｜>Another question"
                 "<｜Assistant｜>",
    "phi4": "<|im_start|>system<|im_sep|>You are a helpful assistant<|im_end|><|im_start|>user<|im_sep|>Hello"
            "<|im_end|><|im_start|>assistant<|im_sep|>Hi there<|im_end|><|im_start|>user<|im_sep|>Who are you"
            "<|im_end|><|im_start|>assistant<|im_sep|>   I am an assistant   <|im_end|><|im_start|>user<|im_sep|>"
            "Another question<|im_end|><|im_start|>assistant<|im_sep|>",
    "zephyr": "<|system|>\nYou are a helpful assistant<|endoftext|>\n<|user|>\nHello<|endoftext|>\n<|assistant|>\n"
              "Hi there<|endoftext|>\n<|user|>\nWho are you<|endoftext|>\n<|assistant|>\n   I am an assistant   "
              "<|endoftext|>\n<|user|>\nAnother question<|endoftext|>\n<|assistant|>\n",
    "llama4": "<|header_start|>system<|header_end|>\n\nYou are a helpful assistant<|eot|><|header_start|>user"
              "<|header_end|>\n\nHello<|eot|><|header_start|>assistant<|header_end|>\n\nHi there<|eot|>"
              "<|header_start|>user<|header_end|>\n\nWho are you<|eot|><|header_start|>assistant<|header_end|>\n\n"
              "I am an assistant<|eot|><|header_start|>user<|header_end|>\n\nAnother question<|eot|>"
              "<|header_start|>assistant<|header_end|>\n\n",
    "granite": "<|start_of_role|>system<|end_of_role|>You are a helpful assistant<|end_of_text|>\n<|start_of_role|>"
               "user<|end_of_role|>Hello<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>Hi there"
               "<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Who are you<|end_of_text|>\n<|start_of_role|>"
               "assistant<|end_of_role|>   I am an assistant   <|end_of_text|>\n<|start_of_role|>user<|end_of_role|>"
               "Another question<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>\n",
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_builtin_renders_llama_cpp_text(name):
    assert ChatTemplate(BUILTIN_TEMPLATES[name], "<s>", "</s>").render(CONVERSATION) == EXPECTED[name]


def test_every_builtin_compiles_and_renders_null_content():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    for name, source in BUILTIN_TEMPLATES.items():
        assert isinstance(ChatTemplate(source).render(msgs), str), name


def test_trim_is_c_isspace_only():
    # llama.cpp trims C's isspace set; a no-break space is content
    out = ChatTemplate(BUILTIN_TEMPLATES["llama3"]).render([{"role": "user", "content": "\t\x0b x\u00a0\n"}],
                                                          add_generation_prompt=False)
    assert out == "<|start_header_id|>user<|end_header_id|>\n\nx\u00a0<|eot_id|>"


def test_resolve_file_builtin_inline_and_unknown(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}!", encoding="utf-8")
    assert resolve_chat_template(str(f)) == ("file", "{{ messages[0]['content'] }}!")
    assert resolve_chat_template("llama3") == ("builtin", BUILTIN_TEMPLATES["llama3"])
    assert resolve_chat_template("{% for m in messages %}x{% endfor %}")[0] == "inline"
    with pytest.raises(ChatTemplateChoiceError) as e:
        resolve_chat_template("llama-3")
    assert str(e.value) == (
        "--chat-template 'llama-3' is not a file, a built-in template name or Jinja text (Jinja contains '{{' "
        "or '{%'); built-in names: " + ", ".join(builtin_names()))
    assert "chatml, command-r, deepseek, deepseek2, deepseek3" in str(e.value)
