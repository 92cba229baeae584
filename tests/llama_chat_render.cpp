// Renders a chat prompt with llama.cpp's own C++ chat-template path: the
// common chat API (common_chat_templates_init / common_chat_templates_apply)
// and its Jinja engine (common/jinja), as llama-server uses them. A reference
// for fle_engine.chat that shares no code with Python's jinja2.
//
// stdin:  one JSON object
//   {"template": str, "bos": str, "eos": str, "messages": [...],
//    "add_generation_prompt": bool, "enable_thinking": bool|null, "tools": [...]|null}
// stdout: the rendered prompt, byte for byte, nothing else.
// Errors: a message on stderr and exit status 1.
//
// llama.cpp's logger writes its info lines to stdout, so stdout is pointed
// at stderr for the whole run and the prompt goes to the original stdout.

#include "chat.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <exception>
#include <iostream>
#include <iterator>
#include <string>
#include <unistd.h>

using request_json = nlohmann::ordered_json;

int main() {
    const int prompt_fd = dup(STDOUT_FILENO);
    if (prompt_fd < 0 || dup2(STDERR_FILENO, STDOUT_FILENO) < 0) {
        std::perror("llama_chat_render: redirecting stdout");
        return 1;
    }
    try {
        const std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
        const request_json req = request_json::parse(text);

        auto tmpls = common_chat_templates_init(/* model */ nullptr, req.at("template").get<std::string>(),
                                                req.value("bos", std::string()), req.value("eos", std::string()));

        common_chat_templates_inputs inputs;
        // messages and tools go through the same OpenAI-style parsers as the server's requests
        inputs.messages = common_chat_msgs_parse_oaicompat(common_json::parse(req.at("messages").dump()));
        if (req.contains("tools") && !req.at("tools").is_null()) {
            inputs.tools = common_chat_tools_parse_oaicompat(common_json::parse(req.at("tools").dump()));
        }
        inputs.add_generation_prompt = req.value("add_generation_prompt", true);
        // the API has no "unset": null keeps its default (true), as a request without the field does
        if (req.contains("enable_thinking") && !req.at("enable_thinking").is_null()) {
            inputs.enable_thinking = req.at("enable_thinking").get<bool>();
        }
        inputs.use_jinja = true;

        const common_chat_params params = common_chat_templates_apply(tmpls.get(), inputs);
        const std::string & prompt = params.prompt;
        size_t done = 0;
        while (done < prompt.size()) {
            const ssize_t n = write(prompt_fd, prompt.data() + done, prompt.size() - done);
            if (n <= 0) {
                std::perror("llama_chat_render: writing the prompt");
                return 1;
            }
            done += (size_t) n;
        }
        close(prompt_fd);
    } catch (const std::exception & e) {
        std::fprintf(stderr, "llama_chat_render: %s\n", e.what());
        return 1;
    }
    return 0;
}
