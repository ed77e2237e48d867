"""Every bad request gets its status and an error body in OpenAI's format naming what is wrong, never a 500, and
the server answers the next good request as if nothing happened."""

import httpx
import openai
import pytest

from tests.server.conftest import MAX_LENGTH

GOOD_COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "temperature": 0}


def completion(**changes):
    return {key: value for key, value in {**GOOD_COMPLETION, **changes}.items() if value is not ...}


def chat(**changes):
    return {key: value for key, value in {**GOOD_CHAT, **changes}.items() if value is not ...}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def assert_error(response, status: int, param=None, message=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == {400: "invalid_request_error", 404: "invalid_request_error",
                             405: "invalid_request_error"}[status]
    if param is not None:
        assert error["param"] == param, error
    if message is not None:
        assert message in error["message"], error
    if code is not None:
        assert error["code"] == code, error


def assert_still_serving(http):
    for path, body in (("/v1/completions", GOOD_COMPLETION), ("/v1/chat/completions", GOOD_CHAT)):
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2


COMPLETION_ERRORS = [
    # (body, param, a part of the message)
    (completion(prompt=...), "prompt", "prompt is required"),
    (completion(prompt=""), "prompt", "prompt is empty"),
    (completion(prompt=[]), "prompt", "prompt is empty"),
    (completion(prompt=[[]]), "prompt", "prompt is empty"),
    (completion(prompt=["a", ""]), "prompt", "prompt is empty"),
    (completion(prompt=3), "prompt", "prompt must be a string, a list of token ids"),
    (completion(prompt=[1, "a"]), "prompt", "prompt must be"),
    (completion(prompt=[1, 10 ** 9]), "prompt", "token id 1000000000 is outside the vocabulary"),
    (completion(prompt=[-1]), "prompt", "token id -1 is outside the vocabulary"),
    (completion(prompt=[5] * MAX_LENGTH), "prompt", f"leaves no room to generate within this model's context of "
                                                    f"{MAX_LENGTH} tokens"),
    (completion(prompt=[5] * 10, max_tokens=MAX_LENGTH), "max_tokens", f"{MAX_LENGTH + 10} were requested"),
    (completion(max_tokens=0), "max_tokens", "greater than or equal to 1"),
    (completion(max_tokens="5"), "max_tokens", "valid integer"),
    (completion(max_tokens=2.5), "max_tokens", "valid integer"),
    (completion(temperature=-0.1), "temperature", "greater than or equal to 0"),
    (completion(temperature=2.5), "temperature", "less than or equal to 2"),
    (completion(temperature="hot"), "temperature", "valid number"),
    (completion(top_p=0), "top_p", "greater than 0"),
    (completion(top_p=1.5), "top_p", "less than or equal to 1"),
    (completion(top_k=-2), "top_k", "greater than or equal to -1"),
    (completion(min_p=1.5), "min_p", "less than or equal to 1"),
    (completion(presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
    (completion(frequency_penalty=-3), "frequency_penalty", "greater than or equal to -2"),
    (completion(repetition_penalty=0), "repetition_penalty", "greater than 0"),
    (completion(seed=2 ** 64), "seed", "less than or equal to"),
    (completion(seed="x"), "seed", "valid integer"),
    (completion(n=0), "n", "greater than or equal to 1"),
    (completion(n=129), "n", "less than or equal to 128"),
    (completion(n=100), "n", "can never fit"),
    (completion(logprobs=21), "logprobs", "less than or equal to 20"),
    (completion(stop=""), "stop", "must not be empty"),
    (completion(stop=[1]), "stop", "stop must be a string or a list of strings"),
    (completion(stop_token_ids=["a"]), "stop_token_ids", "valid integer"),
    (completion(ignore_eos="yes"), "ignore_eos", "valid boolean"),
    (completion(stream_options={"include_usage": True}), "stream_options", "only allowed with stream=true"),
    (completion(echo=True), "echo", "not supported"),
    (completion(suffix="x"), "suffix", "not supported"),
    (completion(best_of=2), "best_of", "not supported"),
    (completion(logit_bias={"5": 1.0}), "logit_bias", "not supported"),
]

CHAT_ERRORS = [
    (chat(messages=...), "messages", "messages is required"),
    (chat(messages=[]), "messages", "messages is empty"),
    (chat(messages="Hello"), "messages", "valid array"),
    (chat(messages=[{"role": "robot", "content": "x"}]), "messages", "messages[0].role"),
    (chat(messages=[{"content": "x"}]), "messages", "messages[0].role is required"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages", "only text parts"),
    (chat(max_completion_tokens=MAX_LENGTH), "max_completion_tokens", "were requested"),
    (chat(max_tokens=MAX_LENGTH), "max_tokens", "were requested"),
    (chat(top_logprobs=21, logprobs=True), "top_logprobs", "less than or equal to 20"),
    (chat(top_logprobs=2), "top_logprobs", "needs logprobs=true"),
    (chat(logprobs=3), "logprobs", "valid boolean"),
    (chat(chat_template_kwargs=[1]), "chat_template_kwargs", "should be an object"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "not supported"),
    (chat(response_format={"type": "json_object"}), "response_format", "is supported by this server"),
    (chat(temperature=3), "temperature", "less than or equal to 2"),
]


@pytest.mark.parametrize("body, param, message", COMPLETION_ERRORS)
def test_bad_completion_requests_are_400_naming_the_parameter(http, body, param, message):
    assert_error(http.post("/v1/completions", json=body), 400, param, message)
    assert_still_serving(http)


@pytest.mark.parametrize("body, param, message", CHAT_ERRORS)
def test_bad_chat_requests_are_400_naming_the_parameter(http, body, param, message):
    assert_error(http.post("/v1/chat/completions", json=body), 400, param, message)
    assert_still_serving(http)


@pytest.mark.parametrize("content, headers, message, code", [
    (b'{"model": "tiny", "prompt": ', {"content-type": "application/json"}, "not valid JSON", "invalid_json"),
    (b"[1, 2]", {"content-type": "application/json"}, "must be a JSON object", "invalid_body"),
    (b"", {"content-type": "application/json"}, "the body is empty", "invalid_body"),
    (b"prompt=Hello", {"content-type": "application/x-www-form-urlencoded"}, "Content-Type: application/json",
     "invalid_content_type"),
    (b'{"prompt": "Hello"}', {"content-type": "text/plain"}, "Content-Type: application/json", "invalid_content_type"),
])
def test_bodies_that_are_not_a_json_object_are_400(http, content, headers, message, code):
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_error(http.post(path, content=content, headers=headers), 400, message=message, code=code)
    assert_still_serving(http)


def test_unknown_models_and_routes_are_404_and_wrong_methods_405(http):
    assert_error(http.post("/v1/completions", json=completion(model="gpt-4")), 404, "model", "'gpt-4' does not exist",
                 "model_not_found")
    assert_error(http.post("/v1/chat/completions", json=chat(model="gpt-4")), 404, "model", code="model_not_found")
    assert_error(http.get("/v1/models/gpt-4"), 404, "model", code="model_not_found")
    assert_error(http.get("/v1/nothing-here"), 404, message="no route GET /v1/nothing-here", code="not_found")
    assert_error(http.get("/v1/completions"), 405, code="method_not_allowed")
    assert_still_serving(http)


def test_the_openai_client_raises_its_own_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="Hello", temperature=5)
    assert error.value.status_code == 400 and "temperature" in error.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hello"}])


def test_bad_requests_are_counted_by_outcome(http):
    before = http.get("/metrics").text
    http.post("/v1/completions", json=completion(temperature=9))
    after = http.get("/metrics").text

    def invalid(text):
        line = next((l for l in text.splitlines() if l.startswith('qwen_triton_requests_total{outcome="invalid"}')),
                    "x 0")
        return int(float(line.split()[-1]))

    assert invalid(after) == invalid(before) + 1
