// Command llm-mesh-gateway serves the llm-mesh Router's annotated RPCs as REST +
// JSON (grpc-gateway), as a sidecar beside the router.
//
// Requests are translated by the handlers protoc-gen-grpc-gateway generates
// from protos/llmmesh/v1/router.proto; this file only adds what a public HTTP
// front needs: timeouts, a body limit, header hygiene, /healthz, the OpenAPI
// spec, and a graceful stop.
package main

import (
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/textproto"
	"os"
	"os/signal"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/golang/protobuf/jsonpb"
	"github.com/golang/protobuf/proto"
	"github.com/golang/protobuf/ptypes"
	"github.com/grpc-ecosystem/grpc-gateway/runtime"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	llmmeshv1 "llmmesh/gen/llmmeshv1"
)

// openAPISpec is the Swagger 2.0 document protoc-gen-swagger wrote from the
// same annotations, so the spec and the routes cannot drift apart.
//
//go:embed openapi.json
var openAPISpec []byte

// internalMetadataPrefix marks metadata only the router may set (the tenant,
// the user): a REST client must not be able to smuggle it in.
const internalMetadataPrefix = "x-llmmesh-"

type config struct {
	listen            string
	upstream          string
	upstreamCA        string
	healthService     string
	maxBodyBytes      int64
	readHeaderTimeout time.Duration
	readBodyTimeout   time.Duration
	idleTimeout       time.Duration
	healthTimeout     time.Duration
	shutdownGrace     time.Duration
}

func parseFlags() config {
	var c config
	flag.StringVar(&c.listen, "listen", envOr("LLMMESH_GATEWAY_LISTEN", "127.0.0.1:8080"), "HTTP listen address (port 0 picks a free one)")
	flag.StringVar(&c.upstream, "upstream", envOr("LLMMESH_GATEWAY_UPSTREAM", "127.0.0.1:50051"), "the router's gRPC address")
	flag.StringVar(&c.upstreamCA, "upstream-ca", envOr("LLMMESH_GATEWAY_UPSTREAM_CA", ""), "PEM CA bundle: dial the router over TLS (plaintext when empty)")
	flag.StringVar(&c.healthService, "health-service", "llmmesh.v1.Router", "gRPC health service name /healthz checks")
	flag.Int64Var(&c.maxBodyBytes, "max-body-bytes", 1<<20, "largest request body accepted; larger ones get 413")
	flag.DurationVar(&c.readHeaderTimeout, "read-header-timeout", 10*time.Second, "time allowed to send the request headers (slowloris guard)")
	flag.DurationVar(&c.readBodyTimeout, "read-body-timeout", 30*time.Second, "time allowed to send the request body once the headers are in (408 past it)")
	flag.DurationVar(&c.idleTimeout, "idle-timeout", 120*time.Second, "keep-alive connections idle longer are closed")
	flag.DurationVar(&c.healthTimeout, "health-timeout", 2*time.Second, "deadline of the router health check behind /healthz")
	flag.DurationVar(&c.shutdownGrace, "shutdown-grace", 30*time.Second, "on SIGTERM, time in-flight requests get to finish")
	flag.Parse()
	if c.maxBodyBytes <= 0 {
		log.Fatalf("--max-body-bytes must be positive, got %d", c.maxBodyBytes)
	}
	return c
}

func envOr(key, fallback string) string {
	if v, ok := os.LookupEnv(key); ok {
		return v
	}
	return fallback
}

func main() {
	log.SetFlags(log.LstdFlags | log.LUTC)
	cfg := parseFlags()

	conn, err := dialRouter(cfg)
	if err != nil {
		log.Fatalf("dial %s: %v", cfg.upstream, err)
	}
	defer conn.Close()
	handler, err := newHandler(cfg, conn)
	if err != nil {
		log.Fatalf("register routes: %v", err)
	}

	server := &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: cfg.readHeaderTimeout,
		// The connection, for limitBody's read deadline (no ReadTimeout: net/http would
		// then bound a whole streamed answer's connection, not just the body's upload).
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, connKey{}, c)
		},
		IdleTimeout: cfg.idleTimeout,
		// No WriteTimeout: a streamed answer lasts as long as generation does;
		// deadlines come from the client's Grpc-Timeout instead.
	}
	listener, err := net.Listen("tcp", cfg.listen)
	if err != nil {
		log.Fatalf("listen %s: %v", cfg.listen, err)
	}
	// Same line shape as the Python services, so launchers and tests can use port 0.
	fmt.Printf("llm-mesh gateway listening on %s (upstream %s)\n", listener.Addr(), cfg.upstream)

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	served := make(chan error, 1)
	go func() { served <- server.Serve(listener) }()

	select {
	case err := <-served:
		log.Fatalf("serve: %v", err)
	case sig := <-stop:
		log.Printf("%s: draining for up to %s", sig, cfg.shutdownGrace)
	}
	// Shutdown closes the listener at once and waits for requests in flight,
	// streams included, to finish.
	ctx, cancel := context.WithTimeout(context.Background(), cfg.shutdownGrace)
	defer cancel()
	if err := server.Shutdown(ctx); err != nil {
		log.Printf("shutdown: %v", err)
	}
}

// dialRouter opens the connection every request shares. The dial does not
// block: the gateway may start before the router, and /healthz tells.
func dialRouter(cfg config) (*grpc.ClientConn, error) {
	creds := grpc.WithInsecure()
	if cfg.upstreamCA != "" {
		tlsCreds, err := credentials.NewClientTLSFromFile(cfg.upstreamCA, "")
		if err != nil {
			return nil, fmt.Errorf("--upstream-ca: %w", err)
		}
		creds = grpc.WithTransportCredentials(tlsCreds)
	}
	// Reconnect within 2 s of the router coming back: grpc's default back-off grows to 120 s,
	// and fail-fast calls do not cut it short, so /healthz and every call said 503 for up to
	// ~40 s after a router restart (the pod stayed unready as long).
	backoff := grpc.WithConnectParams(grpc.ConnectParams{
		Backoff:           grpcbackoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
		MinConnectTimeout: 2 * time.Second,
	})
	return grpc.Dial(cfg.upstream, creds, backoff)
}

// newHandler routes /healthz and /openapi.json here and every other path to
// the generated REST handlers, behind the body limit.
func newHandler(cfg config, conn *grpc.ClientConn) (http.Handler, error) {
	gateway := runtime.NewServeMux(
		runtime.WithMarshalerOption(runtime.MIMEWildcard, strictJSON{&runtime.JSONPb{OrigName: true, EmitDefaults: true}}),
		runtime.WithIncomingHeaderMatcher(incomingHeader),
		runtime.WithOutgoingHeaderMatcher(outgoingHeader),
	)
	// This grpc-gateway release takes its error writers as package variables.
	runtime.HTTPError = httpError
	runtime.OtherErrorHandler = routingError
	client := earlyStreamErrors{llmmeshv1.NewRouterClient(conn)}
	if err := llmmeshv1.RegisterRouterHandlerClient(context.Background(), gateway, client); err != nil {
		return nil, err
	}
	routes := http.NewServeMux()
	routes.HandleFunc("/healthz", healthz(healthpb.NewHealthClient(conn), cfg))
	routes.HandleFunc("/openapi.json", serveSpec)
	routes.Handle("/", limitBody(cfg.maxBodyBytes, cfg.readBodyTimeout, plainMethods(validTimeout(gateway))))
	// The one streamed route: the same chain, plus the newline its last line lacks.
	routes.Handle(chatStreamPath, limitBody(cfg.maxBodyBytes, cfg.readBodyTimeout, plainMethods(validTimeout(endLastLine(gateway)))))
	return routes, nil
}

// chatStreamPath is ChatStream's route (router.proto), answered as newline-delimited JSON.
const chatStreamPath = "/v1/chat:stream"

// earlyStreamErrors makes ChatStream wait for the router's first message before the runtime
// sees the stream. The runtime answers a stream's error in the stream's own shape (a last
// `{"error": …}` line, no Retry-After) even when no byte was sent yet; a refusal before the
// first token (rate limit, overload, bad key) now comes back from the call itself, so it takes
// the unary path: httpError, with its status, JSON body and Retry-After. No later: the runtime
// sends no header before the first message either.
type earlyStreamErrors struct{ llmmeshv1.RouterClient }

func (c earlyStreamErrors) ChatStream(ctx context.Context, in *llmmeshv1.ChatRequest, opts ...grpc.CallOption) (llmmeshv1.Router_ChatStreamClient, error) {
	stream, err := c.RouterClient.ChatStream(ctx, in, opts...)
	if err != nil {
		return nil, err
	}
	first, err := stream.Recv()
	if err != nil && err != io.EOF {
		return nil, err
	}
	return &peekedStream{Router_ChatStreamClient: stream, first: first, firstErr: err}, nil
}

// peekedStream hands back the message (or io.EOF) earlyStreamErrors read, then the rest.
type peekedStream struct {
	llmmeshv1.Router_ChatStreamClient
	first    *llmmeshv1.ChatResponse
	firstErr error
	replayed bool
}

func (s *peekedStream) Recv() (*llmmeshv1.ChatResponse, error) {
	if !s.replayed {
		s.replayed = true
		return s.first, s.firstErr
	}
	return s.Router_ChatStreamClient.Recv()
}

// endLastLine ends a streamed body with a newline: the runtime writes one after each result
// line but none after the error line that ends a failed stream, so a line reader waited for
// more, or dropped it.
func endLastLine(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		lw := &lastByteWriter{ResponseWriter: w}
		next.ServeHTTP(lw, r)
		if lw.last != 0 && lw.last != '\n' {
			_, _ = w.Write([]byte("\n"))
		}
	})
}

// lastByteWriter remembers the last byte written; it stays a Flusher, which the runtime's
// stream forwarding needs (without one it answers 500).
type lastByteWriter struct {
	http.ResponseWriter
	last byte
}

func (w *lastByteWriter) Write(p []byte) (int, error) {
	n, err := w.ResponseWriter.Write(p)
	if n > 0 {
		w.last = p[n-1]
	}
	return n, err
}

func (w *lastByteWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// grpcTimeoutForm is the gRPC spec's TimeoutValue and TimeoutUnit: 1 to 8 digits, then
// Hours, Minutes, Seconds, milli-, micro- or nanoseconds.
var grpcTimeoutForm = regexp.MustCompile(`^([0-9]{1,8})([HMSmun])$`)

var grpcTimeoutUnits = map[string]time.Duration{
	"H": time.Hour, "M": time.Minute, "S": time.Second,
	"m": time.Millisecond, "u": time.Microsecond, "n": time.Nanosecond,
}

// validTimeout answers 400 for a Grpc-Timeout the runtime would misread: it parses any
// integer, so "-5S" and "99999999H" (past time.Duration, so negative) were deadlines already
// gone (504 without calling the router), "0S" meant no deadline at all, and "100000000S"
// was taken although gRPC allows 8 digits.
func validTimeout(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for _, value := range r.Header.Values("Grpc-Timeout") {
			if _, err := parseGRPCTimeout(value); err != nil {
				writeJSONError(w, http.StatusBadRequest, int32(codes.InvalidArgument), fmt.Sprintf("Grpc-Timeout: %v", err))
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

func parseGRPCTimeout(value string) (time.Duration, error) {
	m := grpcTimeoutForm.FindStringSubmatch(value)
	if m == nil {
		return 0, fmt.Errorf("%q is not a timeout: want 1 to 8 digits and a unit H, M, S, m, u or n (500m, 30S, 1M)", value)
	}
	n, _ := strconv.ParseInt(m[1], 10, 64)
	unit := grpcTimeoutUnits[m[2]]
	if n == 0 {
		return 0, fmt.Errorf("%q is out of range: want more than 0", value)
	}
	// 99999999H fits the form but not a time.Duration (about 292 years).
	if n > int64(maxDuration/unit) {
		return 0, fmt.Errorf("%q is out of range: want at most %dH", value, int64(maxDuration/time.Hour))
	}
	return time.Duration(n) * unit, nil
}

const maxDuration = time.Duration(1<<63 - 1)

// plainMethods keeps a request's method and body what the client sent: this grpc-gateway
// release honours X-HTTP-Method-Override, and routes a form-encoded POST by path length
// through a Go map (so at random), which turned curl's empty form POST to /v1/tasks/{id} into
// a CancelTask one call in a few. Every body here is JSON.
func plainMethods(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Header.Del("X-HTTP-Method-Override")
		if strings.HasPrefix(strings.ToLower(r.Header.Get("Content-Type")), "application/x-www-form-urlencoded") {
			r.Header.Set("Content-Type", "application/json")
		}
		next.ServeHTTP(w, r)
	})
}

// connKey holds the request's net.Conn in its context (Server.ConnContext).
type connKey struct{}

// incomingHeader forwards `Grpc-Metadata-*` headers as metadata, except the
// router-internal keys. `Authorization` is forwarded by the runtime itself (as
// `authorization`); every other HTTP header stays HTTP.
func incomingHeader(key string) (string, bool) {
	key = textproto.CanonicalMIMEHeaderKey(key)
	if !strings.HasPrefix(key, runtime.MetadataHeaderPrefix) {
		return "", false
	}
	name := strings.ToLower(strings.TrimPrefix(key, runtime.MetadataHeaderPrefix))
	if name == "" || name == "authorization" || strings.HasPrefix(name, internalMetadataPrefix) {
		return "", false
	}
	return name, true
}

// strictJSON is the runtime's JSON marshaler with a decoder that refuses
// unknown fields: a misspelt "max_token" is a 400 naming it, not an option
// silently ignored (this grpc-gateway release always allows them).
type strictJSON struct{ *runtime.JSONPb }

// The decoder's errors are plain: the generated handlers wrap any of them in
// INVALID_ARGUMENT with "%v", which spelt a status error's own text
// ("rpc error: code = … desc = …") into the message.
func (strictJSON) NewDecoder(r io.Reader) runtime.Decoder {
	d := json.NewDecoder(r)
	return runtime.DecoderFunc(func(v interface{}) error {
		msg, ok := v.(proto.Message)
		if !ok {
			// A body bound to a scalar field keeps the runtime's rules.
			return runtime.DecoderWrapper{Decoder: d}.Decode(v)
		}
		var raw json.RawMessage
		if err := d.Decode(&raw); err != nil {
			return err
		}
		if err := strictUnmarshal(raw, msg); err != nil {
			return fieldError(reflect.TypeOf(msg), raw, err)
		}
		// One JSON value per body: `{…} {"garbage": 1}` was taken, its second value ignored.
		if _, err := d.Token(); err != io.EOF {
			return errors.New("the request body holds more than one JSON value")
		}
		return nil
	})
}

func strictUnmarshal(raw []byte, msg proto.Message) error {
	return (&jsonpb.Unmarshaler{AllowUnknownFields: false}).Unmarshal(bytes.NewReader(raw), msg)
}

// fieldError names the field jsonpb refused: its own errors say what Go type a value did not
// fit (`{"messages": 5}`: "cannot unmarshal number into Go value of type []json.RawMessage"),
// or only what character it choked on, never which field.
func fieldError(msgType reflect.Type, raw json.RawMessage, err error) error {
	if trimmed := bytes.TrimSpace(raw); !bytes.HasPrefix(trimmed, []byte("{")) && !bytes.Equal(trimmed, []byte("null")) {
		return fmt.Errorf("the request body must be a JSON object (%s), not %s", proto.MessageName(reflect.Zero(msgType).Interface().(proto.Message)), excerpt(raw))
	}
	path, value, fieldType, owner := badField(msgType, raw)
	switch {
	case path == "":
		return err
	case fieldType == nil:
		return fmt.Errorf("%s: unknown field (%s has no such field)", path, proto.MessageName(reflect.Zero(owner).Interface().(proto.Message)))
	default:
		return fmt.Errorf("%s: invalid value %s, want %s", path, excerpt(value), describeJSON(fieldType))
	}
}

// badField finds the first field of the JSON object raw (in the body's order) that
// msgType's jsonpb decoding refuses, by decoding each field alone, and goes down into
// messages and lists of messages for the innermost one. It returns the path ("" when
// raw is not an object or no field alone is at fault), the refused value, the field's
// Go type (nil for a field its message does not have), and that message's Go type.
func badField(msgType reflect.Type, raw json.RawMessage) (string, json.RawMessage, reflect.Type, reflect.Type) {
	d := json.NewDecoder(bytes.NewReader(raw))
	if tok, err := d.Token(); err != nil || tok != json.Delim('{') {
		return "", nil, nil, nil
	}
	for d.More() {
		tok, err := d.Token()
		key, ok := tok.(string)
		var value json.RawMessage
		if err != nil || !ok || d.Decode(&value) != nil {
			return "", nil, nil, nil
		}
		alone, _ := json.Marshal(map[string]json.RawMessage{key: value})
		if strictUnmarshal(alone, reflect.New(msgType.Elem()).Interface().(proto.Message)) == nil {
			continue
		}
		fieldType := protoFieldType(msgType, key)
		if fieldType == nil {
			return key, value, nil, msgType
		}
		if isMessage(fieldType) {
			if sub, subValue, subType, owner := badField(fieldType, value); sub != "" {
				return key + "." + sub, subValue, subType, owner
			}
		}
		var items []json.RawMessage
		if fieldType.Kind() == reflect.Slice && isMessage(fieldType.Elem()) && json.Unmarshal(value, &items) == nil {
			for i, item := range items {
				one, _ := json.Marshal(map[string][]json.RawMessage{key: {item}})
				if strictUnmarshal(one, reflect.New(msgType.Elem()).Interface().(proto.Message)) == nil {
					continue
				}
				itemPath := fmt.Sprintf("%s[%d]", key, i)
				if sub, subValue, subType, owner := badField(fieldType.Elem(), item); sub != "" {
					return itemPath + "." + sub, subValue, subType, owner
				}
				return itemPath, item, fieldType.Elem(), msgType
			}
		}
		return key, value, fieldType, msgType
	}
	return "", nil, nil, nil
}

// protoFieldType is the Go type of msgType's field named key (its proto or JSON name),
// oneof members (proto3 `optional` in this build) included; nil when there is none.
func protoFieldType(msgType reflect.Type, key string) reflect.Type {
	structType := msgType.Elem()
	props := proto.GetProperties(structType)
	for i, p := range props.Prop {
		field := structType.Field(i)
		// A oneof's own field (an interface) bears the oneof's name, "_max_tokens": no JSON key.
		if p != nil && p.OrigName != "" && (p.OrigName == key || p.JSONName == key) && !strings.HasPrefix(field.Name, "XXX_") && field.Type.Kind() != reflect.Interface {
			return field.Type
		}
	}
	for _, oneof := range props.OneofTypes {
		if oneof.Prop.OrigName == key || oneof.Prop.JSONName == key {
			return oneof.Type.Elem().Field(0).Type
		}
	}
	return nil
}

// isMessage: a message jsonpb reads field by field, not a well-known type with a JSON form
// of its own (Duration as "1.5s", Struct as any object).
func isMessage(t reflect.Type) bool {
	if t.Kind() != reflect.Ptr || t.Elem().Kind() != reflect.Struct || !t.Implements(reflect.TypeOf((*proto.Message)(nil)).Elem()) {
		return false
	}
	_, wellKnown := reflect.Zero(t).Interface().(interface{ XXX_WellKnownType() string })
	return !wellKnown
}

// describeJSON says what JSON a field of Go type t takes, in the client's terms.
func describeJSON(t reflect.Type) string {
	if msg, ok := reflect.Zero(t).Interface().(proto.Message); ok && t.Kind() == reflect.Ptr {
		if isMessage(t) {
			return "a JSON object (" + proto.MessageName(msg) + ")"
		}
		return "a " + proto.MessageName(msg) + " in its JSON form"
	}
	switch t.Kind() {
	case reflect.Slice:
		if t.Elem().Kind() == reflect.Uint8 {
			return "a base64 string"
		}
		return "a JSON array, each item " + describeJSON(t.Elem())
	case reflect.Map:
		return "a JSON object"
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Int32:
		if _, isEnum := reflect.Zero(t).Interface().(interface{ EnumDescriptor() ([]byte, []int) }); isEnum {
			return "an enum value's name"
		}
		return "an integer"
	case reflect.Int64, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	}
	return "a value of type " + t.String()
}

// excerpt quotes at most 40 bytes of a refused value: enough to recognise it, never a
// whole document echoed back.
func excerpt(value json.RawMessage) string {
	const most = 40
	text := strings.TrimSpace(string(value))
	if len(text) <= most {
		return text
	}
	cut := most
	for cut > 0 && !utf8.RuneStart(text[cut]) {
		cut--
	}
	return text[:cut] + "…"
}

// outgoingHeader passes the router's response metadata on as
// `Grpc-Metadata-*` headers, minus the transport's own (content-type, grpc-*),
// which mean nothing to an HTTP client.
func outgoingHeader(key string) (string, bool) {
	key = strings.ToLower(key)
	if key == "content-type" || strings.HasPrefix(key, "grpc-") {
		return "", false
	}
	return runtime.MetadataHeaderPrefix + key, true
}

// httpError is the runtime's default error reply (HTTP status from the gRPC
// code, JSON body with the message and details) plus `Retry-After` when the
// router said when to come back (RetryInfo on RESOURCE_EXHAUSTED), minus the
// gRPC trailers.
func httpError(ctx context.Context, mux *runtime.ServeMux, m runtime.Marshaler, w http.ResponseWriter, r *http.Request, err error) {
	// A gRPC error sent before any message comes trailers-only, so the call's trailers hold
	// the transport's content-type; the runtime relayed them (unfiltered: the outgoing header
	// matcher only sees headers) as `Grpc-Trailer-*` HTTP trailers, announced in `Trailer:`,
	// which also made every error body chunked. The JSON body already carries the status.
	if md, ok := runtime.ServerMetadataFromContext(ctx); ok && md.TrailerMD != nil {
		md.TrailerMD = nil
		ctx = runtime.NewServerMetadataContext(ctx, md)
	}
	if st, ok := status.FromError(err); ok {
		for _, detail := range st.Details() {
			info, ok := detail.(*errdetails.RetryInfo)
			if !ok || info.RetryDelay == nil {
				continue
			}
			if delay, derr := ptypes.Duration(info.RetryDelay); derr == nil {
				seconds := int64((delay + time.Second - 1) / time.Second)
				w.Header().Set("Retry-After", strconv.FormatInt(seconds, 10))
			}
		}
	}
	runtime.DefaultHTTPError(ctx, mux, m, w, r, err)
}

// routingError answers unknown paths (404) and wrong methods (405) in the same
// JSON shape as every other error, instead of the runtime's plain text.
func routingError(w http.ResponseWriter, _ *http.Request, msg string, httpStatus int) {
	code := int32(codes.InvalidArgument)
	switch httpStatus {
	case http.StatusNotFound:
		code = int32(codes.NotFound)
	case http.StatusMethodNotAllowed:
		code = int32(codes.Unimplemented)
	}
	writeJSONError(w, httpStatus, code, msg)
}

// limitBody reads at most limit bytes of the body before the gateway sees it:
// an oversized request gets 413 and never reaches the router. Buffering also
// lets net/http notice a client that hangs up mid-stream (it watches the
// connection once the body is drained), which cancels the upstream RPC.
func limitBody(limit int64, timeout time.Duration, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength > limit {
			tooLarge(w, limit)
			return
		}
		// A body sent slowly is cut off as slow headers are: 100 uploads stalled one byte short
		// held 186 MB of a sidecar whose limit is 128 Mi, and never timed out.
		conn, _ := r.Context().Value(connKey{}).(net.Conn)
		if conn != nil && timeout > 0 {
			_ = conn.SetReadDeadline(time.Now().Add(timeout))
		}
		body, err := io.ReadAll(io.LimitReader(r.Body, limit+1))
		var timedOut net.Error
		if errors.As(err, &timedOut) && timedOut.Timeout() {
			// The deadline stays: net/http's drain of the rest of the body then fails at once,
			// and the connection closes after the 408.
			w.Header().Set("Connection", "close")
			writeJSONError(w, http.StatusRequestTimeout, int32(codes.DeadlineExceeded), fmt.Sprintf("request body not received within %s", timeout))
			return
		}
		if conn != nil && timeout > 0 {
			_ = conn.SetReadDeadline(time.Time{})
		}
		if err != nil {
			writeJSONError(w, http.StatusBadRequest, int32(codes.InvalidArgument), fmt.Sprintf("reading request body: %v", err))
			return
		}
		if int64(len(body)) > limit {
			tooLarge(w, limit)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		next.ServeHTTP(w, r)
	})
}

func tooLarge(w http.ResponseWriter, limit int64) {
	// Closing the connection spares reading the rest of a body we refused.
	w.Header().Set("Connection", "close")
	writeJSONError(w, http.StatusRequestEntityTooLarge, int32(codes.InvalidArgument), fmt.Sprintf("request body larger than %d bytes", limit))
}

// writeJSONError answers in the runtime's error shape, so clients parse one format
// (details included: it was missing from these until 2026-12-07).
func writeJSONError(w http.ResponseWriter, httpStatus int, grpcCode int32, message string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(httpStatus)
	body := map[string]interface{}{"error": message, "message": message, "code": grpcCode, "details": []interface{}{}}
	_ = json.NewEncoder(w).Encode(body)
}

func serveSpec(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		writeJSONError(w, http.StatusMethodNotAllowed, int32(codes.Unimplemented), "only GET")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(openAPISpec)
}

// healthz answers 200 only while the router's own gRPC health says SERVING,
// so an orchestrator restarts or unroutes the pair, not just the sidecar.
func healthz(client healthpb.HealthClient, cfg config) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), cfg.healthTimeout)
		defer cancel()
		resp, err := client.Check(ctx, &healthpb.HealthCheckRequest{Service: cfg.healthService})
		state, code := "UNKNOWN", http.StatusServiceUnavailable
		detail := ""
		switch {
		case err != nil:
			detail = status.Convert(err).Message()
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				detail = "router health check timed out"
			}
		default:
			state = resp.GetStatus().String()
			if resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
				code = http.StatusOK
			}
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		body := map[string]string{"status": state, "upstream": cfg.upstream}
		if detail != "" {
			body["error"] = detail
		}
		_ = json.NewEncoder(w).Encode(body)
	}
}
