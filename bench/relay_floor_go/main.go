// Command llm-mesh-relay-floor-go is the floor of a native gRPC relay: ChatStream
// forwarded to one replica's Generate with no logic at all, in Go (grpc-go).
//
// Benchmark reference only, never a serving path. It does what
// bench/relay_floor.py does, message for message — open a Generate call per
// stream, send the start, turn each chunk into a ChatResponse, end with a
// TurnEnd — so bench/router.py can show in one run how much of a relay's added
// latency is Python's gRPC and how much this machine charges any relay.
package main

import (
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"

	pb "llmmesh/gen/llmmeshv1"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

type floorRelay struct {
	pb.UnimplementedRouterServer
	replicas []pb.InferenceClient
	turn     uint64
}

// ChatStream relays one answer: replicas in turn, one message out per message in.
func (r *floorRelay) ChatStream(req *pb.ChatRequest, out pb.Router_ChatStreamServer) error {
	n := atomic.AddUint64(&r.turn, 1)
	call, err := r.replicas[n%uint64(len(r.replicas))].Generate(out.Context())
	if err != nil {
		return err
	}
	start := &pb.GenerateStart{RequestId: req.RequestId, Messages: req.Messages, Sampling: req.Sampling}
	if err := call.Send(&pb.GenerateRequest{Action: &pb.GenerateRequest_Start{Start: start}}); err != nil {
		return err
	}
	var seq uint64
	for {
		resp, err := call.Recv()
		if err != nil {
			return err
		}
		seq++
		if chunk := resp.GetChunk(); chunk != nil {
			delta := &pb.TokenDelta{Text: chunk.Text, TokenIds: chunk.TokenIds, Index: chunk.Index}
			event := &pb.ChatResponse_Delta{Delta: delta}
			if err := out.Send(&pb.ChatResponse{RequestId: req.RequestId, Seq: seq, Event: event}); err != nil {
				return err
			}
		} else if done := resp.GetFinished(); done != nil {
			end := &pb.TurnEnd{FinishReason: done.FinishReason, Usage: done.Usage, Timings: done.Timings}
			event := &pb.ChatResponse_End{End: end}
			return out.Send(&pb.ChatResponse{RequestId: req.RequestId, Seq: seq, Event: event})
		}
	}
}

func main() {
	replicas := flag.String("replicas", "", "comma-separated replica addresses (host:port)")
	port := flag.Int("port", 0, "port to listen on, on 127.0.0.1 (0: any free one)")
	flag.String("log-level", "", "accepted for the benchmark's launcher; there is nothing to log")
	flag.Parse()
	if *replicas == "" {
		log.Fatal("--replicas is required")
	}
	relay := &floorRelay{}
	for _, address := range strings.Split(*replicas, ",") {
		conn, err := grpc.Dial(address, grpc.WithInsecure())
		if err != nil {
			log.Fatalf("replica %s: %v", address, err)
		}
		relay.replicas = append(relay.replicas, pb.NewInferenceClient(conn))
	}
	listener, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", *port))
	if err != nil {
		log.Fatal(err)
	}
	server := grpc.NewServer()
	pb.RegisterRouterServer(server, relay)
	healthpb.RegisterHealthServer(server, health.NewServer()) // SERVING from the start
	go func() {
		stop := make(chan os.Signal, 1)
		signal.Notify(stop, syscall.SIGTERM, os.Interrupt)
		<-stop
		server.Stop()
	}()
	// The line the benchmark's launcher waits for, in the services' own format.
	fmt.Printf("llm-mesh relay-floor-go listening on 127.0.0.1:%d\n", listener.Addr().(*net.TCPAddr).Port)
	if err := server.Serve(listener); err != nil {
		log.Fatal(err)
	}
}
