// A Node.js client of llm.v1.Generation built from protos/ alone (@grpc/proto-loader + @grpc/grpc-js),
// as a user of another language would: it asks for the model info, streams one greedy request and
// prints one JSON object with what came back. tests/test_proto_codegen.py runs it.
//
//   node generation_client.js PROTO_DIR TARGET PROMPT MAX_TOKENS
'use strict';
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [protoDir, target, prompt, maxTokens] = process.argv.slice(2);
const definition = protoLoader.loadSync('llm/v1/generation.proto', {
  includeDirs: [protoDir], keepCase: true, longs: String, enums: String, defaults: true, oneofs: true,
});
const llm = grpc.loadPackageDefinition(definition).llm.v1;
const client = new llm.Generation(target, grpc.credentials.createInsecure());
const deadline = () => new Date(Date.now() + 60000);

client.GetModelInfo({}, { deadline: deadline() }, (err, info) => {
  if (err) { console.error(`GetModelInfo: ${err.code} ${err.details}`); process.exit(1); }
  const out = { model: info.model, vocab_size: info.vocab_size, token_ids: [], text: '' };
  const call = client.Generate(
    { text: prompt, sampling: { temperature: 0, max_tokens: Number(maxTokens), ignore_eos: true } },
    { deadline: deadline() });
  call.on('data', (msg) => {
    out.token_ids.push(...msg.token_ids);
    out.text += msg.text;
    if (msg.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
      out.finish_reason = msg.finish_reason;
      out.usage = msg.usage;
    }
  });
  call.on('error', (e) => { console.error(`Generate: ${e.code} ${e.details}`); process.exit(1); });
  call.on('end', () => { console.log(JSON.stringify(out)); client.close(); });
});
