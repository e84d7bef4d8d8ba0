// TokenizerService: the model's tokenizer over gRPC (dgr.v1.TokenizerService), so that a client
// with no GGUF of its own can encode prompts, decode tokens, know the end-of-generation tokens and
// apply the chat template. It reads the engine's vocabulary (read-only, safe beside a forward in
// progress) and authorizes every call as the ShardService of the same worker does.
#pragma once

#include "dgr/shard_engine.h"
#include "dgr/v1/shard.grpc.pb.h"

#include <grpcpp/grpcpp.h>

#include <functional>

namespace dgr::worker {

struct TokenizerLimits {
    size_t max_text_bytes = 4u << 20;   // Tokenize's text, ChatTemplate's content in all
    size_t max_tokens = 1u << 20;       // Detokenize
    size_t max_messages = 4096;         // ChatTemplate
    size_t max_role_bytes = 64;
};

class TokenizerService final : public dgr::v1::TokenizerService::Service {
public:
    using Authorize = std::function<grpc::Status(grpc::ServerContext *)>;

    TokenizerService(const dgr::ShardEngine & engine, Authorize authorize, TokenizerLimits limits = {});

    grpc::Status Tokenize(grpc::ServerContext * ctx, const dgr::v1::TokenizeRequest * req,
                          dgr::v1::TokenizeReply * reply) override;
    grpc::Status Detokenize(grpc::ServerContext * ctx, const dgr::v1::DetokenizeRequest * req,
                            dgr::v1::DetokenizeReply * reply) override;
    grpc::Status Vocabulary(grpc::ServerContext * ctx, const dgr::v1::VocabularyRequest *,
                            dgr::v1::VocabularyReply * reply) override;
    grpc::Status ApplyChatTemplate(grpc::ServerContext * ctx, const dgr::v1::ChatTemplateRequest * req,
                                   dgr::v1::ChatTemplateReply * reply) override;

    // the same checks and work without a call context (the fuzz harness feeds it wire bytes)
    grpc::Status tokenize(const dgr::v1::TokenizeRequest & req, dgr::v1::TokenizeReply * reply) const;
    grpc::Status detokenize(const dgr::v1::DetokenizeRequest & req, dgr::v1::DetokenizeReply * reply) const;
    grpc::Status chat_template(const dgr::v1::ChatTemplateRequest & req, dgr::v1::ChatTemplateReply * reply) const;

private:
    const dgr::ShardEngine & engine_;
    Authorize authorize_;
    TokenizerLimits limits_;
    int32_t n_vocab_;
};

}  // namespace dgr::worker
