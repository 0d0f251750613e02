#!/usr/bin/env python3
"""Rendering oracle for tokenizer/chat tests.

Reads a JSON array of cases from stdin and writes a JSON array of results to
stdout, one per case: {"out": "..."} or {"error": "..."}.

A case is {"template": str, "messages": [...], "add_generation_prompt": bool,
"bos_token": str, "eos_token": str, "tools": [...] or null, "extra": {...}}.

The environment is the one transformers builds in
transformers.utils.chat_template_utils._compile_jinja_template (sandboxed,
trim_blocks, lstrip_blocks, loopcontrols, raise_exception, tojson with
ensure_ascii=False, strftime_now). Message content is prepared as vLLM does for
chat_template_content_format="auto": the template's AST decides between
"openai" (content parts passed through) and "string" (text parts joined with
"\n"), as in vllm/entrypoints/chat_utils.py (_detect_content_format).
"""
import json
import sys
from collections import deque
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt):
    return datetime.now().strftime(fmt)


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


# --- vLLM's content-format detection ---------------------------------------

def _is_var_access(node, varname):
    if isinstance(node, jinja2.nodes.Name):
        return node.ctx == "load" and node.name == varname
    return False


def _is_attr_access(node, varname, key):
    if isinstance(node, jinja2.nodes.Getitem):
        return (_is_var_access(node.node, varname) and isinstance(node.arg, jinja2.nodes.Const)
                and node.arg.value == key)
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node, varname, key=None):
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _iter_assign(root, varname):
    yield root, varname
    related = deque([varname])
    while related:
        rv = related.popleft()
        for a in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems_access(a.node, rv):
                assert isinstance(a.target, jinja2.nodes.Name)
                yield a, a.target.name
                if a.target.name != rv:
                    related.append(a.target.name)


def _iter_messages_item(root):
    names = [v for _, v in _iter_assign(root, "messages")]
    for loop in root.find_all(jinja2.nodes.For):
        for v in names:
            if _is_var_or_elems_access(loop.iter, v):
                assert isinstance(loop.target, jinja2.nodes.Name)
                yield loop, loop.target.name
                break


def _iter_content_item(root):
    names = [v for _, v in _iter_messages_item(root)]
    for loop in root.find_all(jinja2.nodes.For):
        for v in names:
            if _is_var_or_elems_access(loop.iter, v, "content"):
                assert isinstance(loop.target, jinja2.nodes.Name)
                yield loop, loop.target.name
                break


def detect_content_format(env, src):
    try:
        ast = env.parse(src)
    except Exception:
        return "string"
    try:
        next(_iter_content_item(ast))
    except StopIteration:
        return "string"
    except Exception:
        return "string"
    return "openai"


def prepare(messages, fmt):
    """vLLM's _parse_chat_message_content and _postprocess_messages."""
    out = []
    for m in messages:
        c = m.get("content")
        if c is None:
            c = []
        elif isinstance(c, str):
            c = [{"type": "text", "text": c}]
        if fmt == "string":
            r = {"role": m["role"], "content": "\n".join(p["text"] for p in c if p.get("type") == "text")}
        else:
            r = {"role": m["role"], "content": list(c)}
        if m["role"] == "assistant":
            if m.get("tool_calls") is not None:
                r["tool_calls"] = [json.loads(json.dumps(t)) for t in m["tool_calls"]]
            if m.get("reasoning_content") is not None:
                r["reasoning"] = m["reasoning_content"]
                r["reasoning_content"] = m["reasoning_content"]
        elif m["role"] == "tool" and "tool_call_id" in m:
            r["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            r["name"] = m["name"]
        out.append(r)
    for r in out:
        if r["role"] == "assistant" and isinstance(r.get("tool_calls"), list):
            for item in r["tool_calls"]:
                args = item["function"].get("arguments")
                if args:
                    if not isinstance(args, dict):
                        item["function"]["arguments"] = json.loads(args)
                else:
                    item["function"]["arguments"] = {}
    return out


def main():
    cases = json.load(sys.stdin)
    env = make_env()
    results = []
    for c in cases:
        try:
            tmpl = env.from_string(c["template"])
            fmt = detect_content_format(env, c["template"])
            kwargs = dict(c.get("extra") or {})
            kwargs.update(bos_token=c.get("bos_token", ""), eos_token=c.get("eos_token", ""))
            out = tmpl.render(messages=prepare(c["messages"], fmt), tools=c.get("tools"), documents=None,
                              add_generation_prompt=c.get("add_generation_prompt", False), **kwargs)
            results.append({"out": out, "format": fmt})
        except Exception as e:  # noqa: BLE001 - the test compares failures too
            results.append({"error": f"{type(e).__name__}: {e}"})
    json.dump(results, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
