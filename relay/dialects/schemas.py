"""Every front's request, typed: one `relay.dialects.typed.Schema` per dialect — every
field it knows, with the type and range it must have (issue 27).

Each dialect's ``parse`` calls `relay.dialects.typed.check` with its schema first, so a
wrong type or range is a 400 ``invalid_request`` naming the field's path before anything
else reads the body. A further dialect adds its schema here (and one line to
tests/dialects/test_typed_requests.py's ``FRONTS``, which sends every field of every schema, with
wrong types and edge values, to every adapter kind).

Ranges are the providers' own (OpenAI's ``temperature`` 0-2, Anthropic's 0-1,
``top_logprobs`` 0-20, a token count 1 to 2**31 - 1); values are enumerated only where
relay itself reads them (roles, ``tool_choice``, Gemini's ``functionCallingConfig.mode``),
so a provider's new value passes.
"""

from __future__ import annotations

from .typed import ANY, INT64, INT_MAX, Arr, Bool, Int, Num, Obj, OneOf, Schema, Str

__all__ = ["CHAT_ROLES", "CHAT_SCHEMA", "EMBEDDINGS_SCHEMA", "ENCODINGS", "GEMINI_MODES",
           "GEMINI_SCHEMA", "GPARTS", "MESSAGES_SCHEMA", "OLLAMA_CHAT_SCHEMA",
           "OLLAMA_EMBED_SCHEMA", "OLLAMA_GENERATE_SCHEMA", "RESPONSES_SCHEMA", "SCHEMAS"]

_NAME = Str(nonempty=True, nullable=False)
_MODEL = Str(nonempty=True, nullable=False)

# --- OpenAI chat completions ---------------------------------------------------------------
CHAT_ROLES = ("assistant", "developer", "function", "system", "tool", "user")
_PART = Obj({"type": _NAME, "text": Str(),
             "image_url": OneOf(Str(), Obj({"url": Str(), "detail": Str()})),
             "input_audio": Obj({"data": Str(), "format": Str()}),
             "file": Obj({"file_data": Str(), "file_id": Str(), "filename": Str()}),
             "refusal": Str()}, required=("type",))
_FUNCTION_CALL = Obj({"name": Str(), "arguments": Str()})
_MESSAGE = Obj({
    "role": Str(CHAT_ROLES, nullable=False),
    "content": OneOf(Str(), Arr(_PART)), "name": Str(),
    "tool_calls": Arr(Obj({"id": Str(), "type": Str(), "function": _FUNCTION_CALL})),
    "tool_call_id": Str(), "refusal": Str(), "function_call": _FUNCTION_CALL,
    "reasoning_content": Str()}, required=("role",))
CHAT_SCHEMA = Schema("openai", {
    "model": _MODEL, "messages": Arr(_MESSAGE, min_len=1, nullable=False),
    "stream": Bool(), "fallbacks": Arr(Str(nonempty=True)),
    "temperature": Num(0, 2), "top_p": Num(0, 1), "top_k": Int(-1, INT_MAX),
    "presence_penalty": Num(-2, 2), "frequency_penalty": Num(-2, 2),
    "seed": Int(-INT64 - 1, INT64), "reasoning_effort": Str(nonempty=True),
    "verbosity": Str(("low", "medium", "high")), "user": Str(),
    "metadata": Obj(rest=Str()), "safety_identifier": Str(), "store": Bool(),
    "service_tier": Str(), "prompt_cache_key": Str(), "prompt_cache_retention": Str(),
    "prompt_cache_options": Obj(),
    "prediction": Obj({"type": Str(), "content": OneOf(Str(), Arr(_PART))}),
    "max_tokens": Int(1, INT_MAX), "max_completion_tokens": Int(1, INT_MAX),
    "stream_options": Obj({"include_usage": Bool(), "include_obfuscation": Bool()}),
    "tools": Arr(Obj({"type": _NAME, "function": Obj({
        "name": _NAME, "description": Str(), "parameters": Obj(), "strict": Bool()},
        required=("name",))}, required=("type",))),
    "tool_choice": OneOf(Str(("auto", "none", "required")), Obj({
        "type": _NAME, "function": Obj({"name": Str()})}, required=("type",))),
    "parallel_tool_calls": Bool(),
    "functions": Arr(Obj({"name": _NAME, "description": Str(), "parameters": Obj()},
                         required=("name",))),
    "function_call": OneOf(Str(("auto", "none")), Obj({"name": _NAME}, required=("name",))),
    "stop": OneOf(Str(), Arr(Str())), "n": Int(1, INT_MAX), "logprobs": Bool(),
    "top_logprobs": Int(0, 20), "logit_bias": Obj(rest=Num(-100, 100)),
    "response_format": Obj({"type": _NAME, "json_schema": Obj({
        "name": Str(), "description": Str(), "schema": Obj(), "strict": Bool()})},
        required=("type",)),
    "modalities": Arr(Str()), "audio": Obj({"voice": Str(), "format": Str()}),
    "web_search_options": Obj(), "moderation": Obj(),
}, required=("model", "messages"))

# --- Anthropic Messages (and count_tokens, which lends it a max_tokens) --------------------
_CACHE = Obj({"type": Str(), "ttl": Str()})
_TEXT = Obj({"type": _NAME, "text": Str(), "cache_control": _CACHE, "citations": ANY},
            required=("type",))
_BLOCK = Obj({
    "type": _NAME, "text": Str(), "id": Str(), "name": Str(), "input": Obj(),
    "tool_use_id": Str(), "is_error": Bool(), "content": OneOf(Str(), Arr(_TEXT)),
    # (a search_result block's source is a string)
    "source": OneOf(Str(), Obj({"type": Str(), "media_type": Str(), "data": Str(),
                                "url": Str()})),
    "thinking": Str(), "signature": Str(), "data": Str(), "cache_control": _CACHE,
    "title": Str(), "context": Str()}, required=("type",))
MESSAGES_SCHEMA = Schema("anthropic", {
    "model": _MODEL,
    "messages": Arr(Obj({"role": Str(("user", "assistant", "system"), nullable=False),
                         "content": OneOf(Str(), Arr(_BLOCK), nullable=False)},
                        required=("role", "content")), min_len=1, nullable=False),
    "max_tokens": Int(1, INT_MAX, nullable=False),
    "system": OneOf(Str(), Arr(_TEXT)), "stream": Bool(), "fallbacks": Arr(Str()),
    "stop_sequences": Arr(Str()), "temperature": Num(0, 1), "top_p": Num(0, 1),
    "top_k": Int(0, INT_MAX),
    "tools": Arr(Obj({"name": _NAME, "type": Str(), "description": Str(),
                      "input_schema": Obj(), "strict": Bool(), "cache_control": _CACHE,
                      "defer_loading": Bool(), "eager_input_streaming": Bool(),
                      "input_examples": Arr(Obj()), "allowed_callers": Arr(Str())},
                     required=("name",))),
    "tool_choice": Obj({"type": Str(("auto", "any", "tool", "none"), nullable=False),
                        "name": Str(), "disable_parallel_tool_use": Bool()},
                       required=("type",)),
    "metadata": Obj({"user_id": Str()}),
    "output_config": Obj({"effort": Str(), "format": Obj({"type": Str(), "schema": Obj()})}),
    "thinking": Obj({"type": _NAME, "budget_tokens": Int(1, INT_MAX), "display": Str()},
                    required=("type",)),
    "service_tier": Str(), "container": OneOf(Str(), Obj()), "mcp_servers": Arr(Obj()),
    "context_management": Obj(), "inference_geo": Str(), "speed": Str(),
    "diagnostics": Obj(), "user_profile_id": Str(), "workspace_id": Str(),
    "cache_control": _CACHE,   # (the request's own: automatic prompt caching)
}, required=("model", "max_tokens", "messages"))

# --- OpenAI Responses ------------------------------------------------------------------------
_RPART = Obj({"type": _NAME, "text": Str(), "image_url": Str(), "file_data": Str(),
              "file_id": Str(), "file_url": Str(), "filename": Str(), "detail": Str(),
              "refusal": Str()}, required=("type",))
_RCONTENT = OneOf(Str(), Arr(_RPART))
_ITEM = Obj({"type": Str(), "role": Str(), "content": _RCONTENT, "id": Str(),
             "status": Str(), "call_id": Str(), "name": Str(), "namespace": Str(),
             "arguments": Str(), "input": Str(), "output": _RCONTENT,
             "encrypted_content": Str(), "summary": Arr(Obj())})
_FORMAT = Obj({"type": _NAME, "name": Str(), "schema": Obj(), "strict": Bool(),
               "description": Str()}, required=("type",))
RESPONSES_SCHEMA = Schema("responses", {
    "model": _MODEL,
    "input": OneOf(Str(), Arr(OneOf(_ITEM, want="an object")), nullable=False),
    "instructions": Str(), "stream": Bool(), "store": Bool(),
    "previous_response_id": Str(nonempty=True), "fallbacks": Arr(Str()),
    "tools": Arr(Obj({"type": _NAME, "name": Str(), "description": Str(),
                      "parameters": Obj(), "strict": Bool(), "tools": Arr(Obj()),
                      "format": Obj()}, required=("type",))),
    "tool_choice": OneOf(Str(("auto", "none", "required")), Obj({
        "type": _NAME, "name": Str(), "mode": Str(("auto", "required")),
        "tools": Arr(Obj())}, required=("type",))),
    "parallel_tool_calls": Bool(),
    "text": Obj({"format": _FORMAT, "verbosity": Str(("low", "medium", "high"))}),
    "reasoning": Obj({"effort": Str(), "summary": Str(), "generate_summary": Str()}),
    "max_output_tokens": Int(1, INT_MAX), "temperature": Num(0, 2), "top_p": Num(0, 1),
    "top_logprobs": Int(0, 20), "user": Str(), "include": Arr(Str()),
    "stream_options": Obj({"include_obfuscation": Bool()}),
    "truncation": Str(("auto", "disabled")), "service_tier": Str(),
    "background": Bool(), "conversation": OneOf(Str(), Obj()), "prompt": Obj(),
    "metadata": Obj(rest=Str()), "prompt_cache_key": Str(), "prompt_cache_retention": Str(),
    "prompt_cache_options": Obj(), "safety_identifier": Str(), "client_metadata": Obj(),
    "max_tool_calls": Int(1, INT_MAX), "context_management": OneOf(Arr(Obj()), Obj()),
}, required=("model", "input"))

# --- OpenAI embeddings (``input``'s forms are read by its parser) ---------------------------
ENCODINGS = ("float", "base64")
EMBEDDINGS_SCHEMA = Schema("embeddings", {
    "model": _MODEL, "encoding_format": Str(ENCODINGS), "dimensions": Int(1, INT_MAX),
    "user": Str(), "fallbacks": Arr(Str())})

# --- Gemini generateContent (and countTokens; the model is in the path) --------------------
# Google's JSON names (lowerCamelCase), the ones its SDKs and the Gemini CLI send; ranges
# are Google's own (temperature 0-2, the penalties -2 to 2, int32 counts and seed).
# ``topK`` is a number: google-genai types it as a float and sends ``40.0``.
_BLOB = Obj({"mimeType": Str(nullable=False), "data": Str(nullable=False),
             "displayName": Str()}, required=("mimeType", "data"))
_FILE = Obj({"mimeType": Str(nullable=False), "fileUri": Str(nullable=False),
             "displayName": Str()}, required=("mimeType", "fileUri"))
_GPART = Obj({
    "text": Str(), "thought": Bool(), "thoughtSignature": Str(),
    "inlineData": _BLOB, "fileData": _FILE,
    "functionCall": Obj({"id": Str(), "name": Str(nullable=False), "args": Obj()},
                        required=("name",)),
    "functionResponse": Obj({"id": Str(), "name": Str(nullable=False), "response": Obj(),
                             "willContinue": Bool(), "scheduling": Str(),
                             "parts": Arr(Obj())}, required=("name",)),
    "executableCode": Obj({"language": Str(), "code": Str()}),
    "codeExecutionResult": Obj({"outcome": Str(), "output": Str()}),
    "videoMetadata": Obj(), "partMetadata": Obj(), "mediaResolution": OneOf(Str(), Obj())})
_GPARTS = GPARTS = Arr(_GPART, nullable=False)
_DECLARATION = Obj({"name": _NAME, "description": Str(), "behavior": Str(),
                    "parameters": Obj(), "parametersJsonSchema": Obj(),
                    "response": Obj(), "responseJsonSchema": Obj()}, required=("name",))
GEMINI_MODES = ("AUTO", "ANY", "NONE", "VALIDATED", "MODE_UNSPECIFIED")
GEMINI_SCHEMA = Schema("gemini", {
    "model": Str(), "fallbacks": Arr(Str(nonempty=True)),
    "contents": Arr(Obj({"role": Str(("user", "model")), "parts": _GPARTS},
                        required=("parts",)), min_len=1, nullable=False),
    "systemInstruction": OneOf(Str(), Obj({"role": Str(), "parts": _GPARTS},
                                          required=("parts",))),
    "tools": Arr(Obj({"functionDeclarations": Arr(_DECLARATION), "googleSearch": Obj(),
                      "googleSearchRetrieval": Obj(), "codeExecution": Obj(),
                      "urlContext": Obj(), "retrieval": Obj(), "computerUse": Obj(),
                      "fileSearch": Obj(), "googleMaps": Obj()})),
    "toolConfig": Obj({"functionCallingConfig": Obj({
        "mode": Str(GEMINI_MODES), "allowedFunctionNames": Arr(Str())}),
        "retrievalConfig": Obj()}),
    "generationConfig": Obj({
        "temperature": Num(0, 2), "topP": Num(0, 1), "topK": Num(0, INT_MAX),
        "seed": Int(-INT_MAX - 1, INT_MAX), "presencePenalty": Num(-2, 2),
        "frequencyPenalty": Num(-2, 2), "maxOutputTokens": Int(1, INT_MAX),
        "candidateCount": Int(1, INT_MAX), "stopSequences": Arr(Str()),
        "responseMimeType": Str(), "responseSchema": Obj(), "responseJsonSchema": Obj(),
        "responseLogprobs": Bool(), "logprobs": Int(0, 20),
        "responseModalities": Arr(Str()), "mediaResolution": Str(),
        "thinkingConfig": Obj({"includeThoughts": Bool(), "thinkingBudget": Int(-1, INT_MAX),
                               "thinkingLevel": Str()}),
        "speechConfig": Obj(), "imageConfig": Obj(), "routingConfig": Obj(),
        "enableEnhancedCivicAnswers": Bool(), "audioTimestamp": Bool(),
        "enableAffectiveDialog": Bool()}),
    "safetySettings": Arr(Obj({"category": Str(), "threshold": Str(), "method": Str()})),
    "cachedContent": Str(), "labels": Obj(rest=Str()), "serviceTier": Str(),
}, required=("contents",))

# --- Ollama's API (SPEC A10): /api/chat, /api/generate, /api/embed and /api/embeddings -----
# Ollama's own ranges where relay reads a value (``num_predict`` -1 and -2: no limit);
# the sampling ranges are OpenAI's, which every provider behind relay takes. Options
# relay does not know pass the check and meet the field policy by name.
_OPTIONS = Obj({
    "temperature": Num(0, 2), "top_p": Num(0, 1), "top_k": Int(0, INT_MAX),
    "seed": Int(-INT64 - 1, INT64), "num_predict": Int(-2, INT_MAX),
    "stop": OneOf(Str(), Arr(Str())), "presence_penalty": Num(-2, 2),
    "frequency_penalty": Num(-2, 2), "num_ctx": Int(1, INT_MAX)})
_OLLAMA_FORMAT = OneOf(Str(), Obj())
_THINK = OneOf(Bool(), Str(("low", "medium", "high")))
_KEEP_ALIVE = OneOf(Str(), Num())
_OLLAMA_COMMON = {
    "model": _MODEL, "stream": Bool(), "format": _OLLAMA_FORMAT, "options": _OPTIONS,
    "keep_alive": _KEEP_ALIVE, "think": _THINK, "fallbacks": Arr(Str(nonempty=True)),
    "logprobs": Bool(), "top_logprobs": Int(0, 20)}
_OTOOL_CALL = Obj({"id": Str(), "type": Str(), "function": Obj({
    "index": Int(0, INT_MAX), "name": _NAME, "arguments": Obj()}, required=("name",))},
    required=("function",))
OLLAMA_CHAT_SCHEMA = Schema("ollama", {
    **_OLLAMA_COMMON,
    "messages": Arr(Obj({
        "role": Str(("system", "user", "assistant", "tool"), nullable=False),
        "content": Str(), "images": Arr(Str(nullable=False)), "thinking": Str(),
        "tool_calls": Arr(_OTOOL_CALL), "tool_name": Str(), "tool_call_id": Str()},
        required=("role",))),
    "tools": Arr(Obj({"type": Str(), "function": Obj({
        "name": _NAME, "description": Str(), "parameters": Obj()}, required=("name",))},
        required=("function",))),
}, required=("model",))
OLLAMA_GENERATE_SCHEMA = Schema("ollama_generate", {
    **_OLLAMA_COMMON, "prompt": Str(), "suffix": Str(), "system": Str(), "template": Str(),
    "context": Arr(Int()), "raw": Bool(), "images": Arr(Str(nullable=False)),
}, required=("model",))
OLLAMA_EMBED_SCHEMA = Schema("ollama_embed", {
    "model": _MODEL, "input": OneOf(Str(), Arr(Str(nullable=False))), "prompt": Str(),
    "truncate": Bool(), "options": _OPTIONS, "keep_alive": _KEEP_ALIVE,
    "dimensions": Int(1, INT_MAX)}, required=("model",))

SCHEMAS: dict[str, Schema] = {s.name: s for s in (
    CHAT_SCHEMA, MESSAGES_SCHEMA, RESPONSES_SCHEMA, EMBEDDINGS_SCHEMA, GEMINI_SCHEMA,
    OLLAMA_CHAT_SCHEMA, OLLAMA_GENERATE_SCHEMA, OLLAMA_EMBED_SCHEMA)}
