"""llama.cpp's own server tests (tools/server/tests of the llama-cpp-python sdist) against kvserve on
the default model, offline: the files for the basic, chat, completion, security, template, tokenize,
metrics and tool-call features (:mod:`tests.llama_cpp_suite`). Opt-in: set ``$KVSERVE_LLAMA_CPP_TESTS``
to the suite's directory (``tools/server/tests`` of the unpacked llama-cpp-python 0.3.36 sdist);
skipped otherwise."""

from __future__ import annotations

import re

import pytest

from tests.llama_cpp_suite import find_suite, run_suite

#: the tests of those files (``-m "not slow"``, as the suite's tests.sh runs them) that failed on
#: kvserve in a run on 2026-12-06 (most expect the text of the suite's own tiny models, which SmolLM2
#: does not write; some were fixed after that run); any other failure fails this test
KNOWN_FAILURES: frozenset[str] = frozenset({
    'unit/test_basic.py::test_load_split_model',
    'unit/test_basic.py::test_no_ui',
    'unit/test_basic.py::test_server_model_aliases_and_tags',
    'unit/test_basic.py::test_server_props',
    "unit/test_chat_completion.py::test_chat_completion[None-Book-Hey-8-But she couldn't-69-8-length-False-None]",
    "unit/test_chat_completion.py::test_chat_completion[None-Book-Hey-8-But she couldn't-69-8-length-True-None]",
    'unit/test_chat_completion.py::test_chat_completion[None-Book-What is the best book-8-(Suddenly)+|\\\\{ " Sarax.-77-8-length-False-None]',
    'unit/test_chat_completion.py::test_chat_completion[None-Book-What is the best book-8-(Suddenly)+|\\\\{ " Sarax.-77-8-length-True-None]',
    'unit/test_chat_completion.py::test_chat_completion[None-Book-What is the best book-8-(Suddenly)+|\\\\{ " Sarax.-77-8-length-True-chatml]',
    'unit/test_chat_completion.py::test_chat_completion[None-Book-What is the best book-8-^ blue-23-8-length-True-This is not a chat template, it is]',
    'unit/test_chat_completion.py::test_chat_completion[None-Book-user_prompt8-8-Whillicter-79-8-length-False-None]',
    'unit/test_chat_completion.py::test_chat_completion[None-Book-user_prompt9-8-Whillicter-79-8-length-True-None]',
    'unit/test_chat_completion.py::test_chat_completion[codellama70b-You are a coding assistant.-Write the fibonacci function in c++.-128-(Aside|she|felter|alonger)+-104-128-length-False-None]',
    'unit/test_chat_completion.py::test_chat_completion[codellama70b-You are a coding assistant.-Write the fibonacci function in c++.-128-(Aside|she|felter|alonger)+-104-128-length-True-None]',
    'unit/test_chat_completion.py::test_chat_completion_cached_tokens',
    'unit/test_chat_completion.py::test_chat_completion_stream[Book-What is the best book-8-(Suddenly)+-77-8-length]',
    'unit/test_chat_completion.py::test_chat_completion_stream[You are a coding assistant.-Write the fibonacci function in c++.-128-(Aside|she|felter|alonger)+-104-128-length]',
    'unit/test_chat_completion.py::test_chat_completion_with_openai_library',
    'unit/test_chat_completion.py::test_chat_template',
    'unit/test_chat_completion.py::test_chat_template_assistant_prefill[prefill1-Wh\\n\\nill]',
    'unit/test_chat_completion.py::test_completion_with_response_format[response_format1-10-[ -3000 ]]',
    'unit/test_completion.py::test_completion[I believe the meaning of life is-8-(going|bed)+-18-8-False-False]',
    'unit/test_completion.py::test_completion[Write a joke about AI from a very long prompt which will not be truncated-64-(princesses|everyone|kids|Anna|forest)+-46-64-False-True]',
    'unit/test_completion.py::test_completion_prompt_cache',
    'unit/test_completion.py::test_completion_response_fields[I believe the meaning of life is-32-response_fields1]',
    'unit/test_completion.py::test_completion_stream[I believe the meaning of life is-8-(going|bed)+-18-8-False]',
    'unit/test_completion.py::test_completion_stream[Write a joke about AI from a very long prompt which will not be truncated-64-(princesses|everyone|kids|Anna|forest)+-46-64-False]',
    'unit/test_completion.py::test_completion_stream_with_openai_library',
    'unit/test_completion.py::test_completion_stream_with_openai_library_stops',
    'unit/test_completion.py::test_completion_with_openai_library',
    'unit/test_completion.py::test_nocache_long_input_prompt',
    'unit/test_metrics.py::test_metrics_generation_rate_excludes_first_token',
    'unit/test_metrics.py::test_metrics_timings_on_prompt_progress',
    'unit/test_security.py::test_access_static_assets_without_api_key',
    'unit/test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers',
    'unit/test_security.py::test_local_media_file[../../../tools-file:////mtmd//test-1.jpeg-True]',
    'unit/test_security.py::test_local_media_file[../../../tools-file://mtmd/test-1.jpeg-True]',
    'unit/test_tokenize.py::test_tokenize_with_bos',
})


@pytest.mark.slow
def test_llama_cpp_server_suite(smollm2_path, tmp_path):
    suite = find_suite()
    if suite is None:
        pytest.skip("llama.cpp's server tests are not here (set KVSERVE_LLAMA_CPP_TESTS)")
    passed, failed, out = run_suite(suite, smollm2_path, tmp_path, ["-rfE", "-m", "not slow"])
    failures = set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M))
    assert passed > 0, out[-4000:]
    assert failures - KNOWN_FAILURES == set(), out[-4000:]
